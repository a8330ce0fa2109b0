"""Next-token loss shared by every model family: mean over counted labels, vocab-parallel under TP."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed.fleet.layers.mpu import mp_layers

from modeling.autocast import full_precision
from modeling.context_parallel import ahead_in_sequence
from modeling.documents import as_state, positions_among
from modeling.execution import Execution

IGNORE_INDEX = -100


class CausalLMCriterion(nn.Layer):
    """Mean cross-entropy over labels that are not IGNORE_INDEX; with multi-token prediction's
    logits (a tuple: the next token's, then depth k's for the token k + 1 further, `blocks/
    prediction.py`) plus `mtp_weight` (lambda / D) times each depth's mean over the positions whose
    token that far on is in the sample (the labels shifted by k), and, when the positions restart
    per document (given after the logits), whose token k further is in their own document.

    Under TP the logits stay split by vocabulary and `ParallelCrossEntropy` reduces across ranks,
    so the full logits are never gathered. Under context parallelism each rank holds part of every
    sequence: its loss is its summed token losses over the count of the whole sequences' counted
    labels, so the cp ranks' losses (and, summed over cp by the gradient reduction, their
    gradients) add up to the single-card mean, whatever each part holds.

    Under the loss per optimizer step (`modeling.step_loss`) the mean is replaced by the summed token
    losses times the step's weight per token, set by the trainer before the step."""

    def __init__(self, run: Execution, mtp_weight: float = 0.0):
        super().__init__()
        self.parallel = mp_layers.ParallelCrossEntropy(ignore_index=IGNORE_INDEX) if run.tp > 1 else None
        self.ring, self.mtp_weight = run.ring, mtp_weight
        self.prediction_losses = run.prediction_losses  # where each depth's loss goes for the metrics
        self.step_loss = run.step_loss  # set per optimizer step under the loss per step (`step_loss.py`)

    def forward(self, logits, labels):
        logits = as_state(logits)
        if not isinstance(logits, tuple):
            return self.mean(logits, labels)
        main, *rest = logits
        positions, depths = positions_among(rest)  # positions when they restart per document
        loss = self.mean(main, labels)
        for depth, ahead in enumerate(depths, start=1):
            shifted = ahead_in_sequence(labels, depth, IGNORE_INDEX, self.ring)
            if positions is not None:  # token i + depth must be in token i's document
                inside = ahead_in_sequence(positions, depth, -1, self.ring) == positions + depth
                shifted = paddle.where(inside, shifted, paddle.full_like(shifted, IGNORE_INDEX))
            predicted = self.mean(ahead, shifted)
            self.prediction_losses.append(predicted.detach())
            loss = loss + self.mtp_weight * predicted
        return loss

    def mean(self, logits, labels):
        """The mean next-token loss of `logits` against `labels`."""
        with full_precision():  # in fp32 whatever the compute dtype, as PaddleNLP's criterion
            logits = logits.astype("float32")
            if self.parallel is not None:
                token_loss = self.parallel(logits, labels.unsqueeze(-1))
            else:
                token_loss = F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none",
                                             ignore_index=IGNORE_INDEX)
            counted = (labels != IGNORE_INDEX).astype("float32").unsqueeze(-1)
            summed = (token_loss * counted).sum()
            if self.step_loss.per_token is not None:  # every supervised token of the step weighs the same
                return summed * self.step_loss.per_token
            count = counted.sum() if self.ring is None else self.ring.all_reduce(counted.sum())
            return summed / count.clip(min=1.0)
