"""The loss per optimizer step: every supervised token of the step weighs the same.

With masked labels (fine-tuning on chat data trains only the assistant's tokens) the counted labels
differ from micro-batch to micro-batch and from data rank to data rank. A mean per micro-batch, then
a mean of the means (what PaddleFormers' SFT criterion and PaddleNLP's pretraining do), weighs a
token of a short answer more than one of a long answer, and its gradients change with the
accumulation steps and the data degree. The step's loss here is the sum of every token's loss over
the supervised tokens of the whole step, across micro-batches, pipeline micro-batches and data
ranks (Megatron's `calculate_per_token_loss`, transformers' `num_items_in_batch`).

The trainer counts the step's supervised tokens before its first forward (one all-reduce over the
data ranks) and sets `StepLoss.per_token`; the criterion then multiplies each micro-batch's summed
token losses by it. The schedule's division by the accumulation steps and the gradient reduction's
mean over data ranks stay as they are, so the weight carries both back: accumulate_steps x data
replicas / step tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepLoss:
    """The weight of one supervised token's loss in this optimizer step (None: a mean per micro-batch)."""

    per_token: float | None = None

    def set_step(self, step_tokens: int, accumulate_steps: int, data_replicas: int) -> None:
        """Weigh every token of a step of `step_tokens` supervised tokens alike (a step with none trains nothing)."""
        self.per_token = accumulate_steps * data_replicas / max(step_tokens, 1)

    def clear(self) -> None:
        self.per_token = None
