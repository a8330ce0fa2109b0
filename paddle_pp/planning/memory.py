"""Will a layout run, and what does each rank hold in memory? Answered from the model config alone,
offline: weights, gradients and AdamW states as ZeRO partitions them, and the decoder layers'
activations from each family's per-layer model (`ModelFamily.layer_activation_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from modeling.registry import family_of, plan_of, validate_layout
from modeling.sequence_parallel import sequence_shards
from paddle_pp.runtime.flags import flag
from paddle_pp.runtime.layout import Layout

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class Workload:
    """What a rank's activations depend on besides the layout (the trainer's flags of the same names)."""

    per_device_train_batch_size: int = flag(4, "micro-batch size per data replica")
    max_seq_length: int = flag(128, "tokens per training sample")
    gradient_accumulation_steps: int = flag(2, "micro-batches per step (the pipeline's accumulate steps)")
    recompute: bool = flag(False, "recompute each decoder layer in backward")


@dataclass(frozen=True)
class RankShare:
    """What every rank at one (pipeline stage, tp rank) holds; dp and sharding ranks repeat it."""

    stage: int
    tp_rank: int
    parameters: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def load_bytes(self) -> int:
        """What this rank reads to resume: its fp32 weight slices and its share of optimizer states."""
        return self.parameters * 4 + self.optimizer_bytes


def decoder_activation_bytes(config, layout: Layout, workload: Workload, stage: int, compute_bytes: int = 4) -> int:
    """What the decoder layers of pipeline stage `stage` keep for backward at the peak of a step,
    from the family's per-layer model (`modeling/<family>/activations.py`, exact in fp32).

    One micro-batch is alive without pp (each is backpropagated before the next); under 1F1B stage k
    holds min(pp - k, micro-batches), the interleaved schedule (vpp) 1 + (pp - 1) / (pp x vpp) times
    that (Megatron's count). With recompute a layer keeps only its input (split along the sequence
    under SP) and one layer at a time is rebuilt in full. Embedding, head and loss are not included."""
    per_layer = sum(family_of(config).layer_activation_bytes(
        config, workload.per_device_train_batch_size, workload.max_seq_length, layout.tp, layout.sequence_parallel,
        compute_bytes).values())
    layers = config.num_hidden_layers // layout.pp
    in_flight = 1.0 if layout.pp == 1 else min(layout.pp - stage, workload.gradient_accumulation_steps)
    if layout.vpp > 1:
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    if not workload.recompute:
        return int(layers * in_flight * per_layer)
    tokens = workload.per_device_train_batch_size * workload.max_seq_length
    layer_input = tokens * config.hidden_size * compute_bytes // sequence_shards(layout.tp, layout.sequence_parallel)
    return int(layers * in_flight * layer_input) + per_layer


def plan_layout(config, layout: Layout, compute_bytes: int = 4, workload: Workload | None = None) -> list[RankShare]:
    """Per (stage, tp rank): parameters and bytes of weights, grads and AdamW states (plus fp32
    master weights when compute is narrower than fp32), as ZeRO partitions them over the sharding
    degree: states from stage1, gradients from stage2, weights from stage3 (whose parameters under
    `--stage3_segment_size`, the norm weights, stay whole: left out here); with a `workload`, the
    decoder layers' activations too (`decoder_activation_bytes`). Raises the layout's own errors
    when invalid."""
    validate_layout(config, layout)
    if workload:
        layout.check_sequence_length(workload.max_seq_length)
    plan = plan_of(config)
    counts = np.zeros([layout.pp, layout.tp], dtype=np.int64)
    for name, row in plan.items():
        numel = int(np.prod(row.shape))
        for stage in plan.stages(name, layout.pp, layout.vpp):
            counts[stage] += numel // layout.tp if row.tp_axis is not None else numel
    state_bytes = ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0)
    shard = layout.sharding_degree
    grad_shards = shard if layout.group_sharded_level else 1  # stage2 and stage3
    weight_shards = shard if layout.sharding_stage == "stage3" else 1
    return [RankShare(stage, tp, int(n), -(-int(n) * compute_bytes // weight_shards),
                      -(-int(n) * compute_bytes // grad_shards), -(-int(n) * state_bytes // shard),
                      decoder_activation_bytes(config, layout, workload, stage, compute_bytes) if workload else 0)
            for (stage, tp), n in np.ndenumerate(counts)]
