"""Will a layout run, and what does each rank hold in memory? Answered from the model config alone,
offline: weights, gradients and AdamW states as ZeRO partitions them, and the decoder layers'
activations from each family's per-layer model (`ModelFamily.layer_activations`, built from the
blocks' and attention cores' `saved_bytes`) for the run's attention core and recompute."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from modeling.attention_core.ring import ring_traffic_bytes
from modeling.execution import Execution
from modeling.lora import LoRA, is_adapter
from modeling.placement import layer_stage
from modeling.registry import check_context_parts, execution_for, family_of, plan_of, validate_layout
from modeling.sequence_parallel import sequence_shards
from paddle_pp.planning.schedules import in_flight, resolve_schedule
from paddle_pp.runtime.layout import Layout

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class Workload:
    """What a rank's activations depend on besides the layout: a run plan's micro-batch, tokens per
    sequence, micro-batches per step and execution (`paddle_pp.training.run_plan.RunPlan.workload`:
    the trainer's own decisions, so the planner cannot size another run than the one that would start)."""

    micro_batch: int
    seq_len: int
    accumulate_steps: int
    execution: Execution

    @property
    def recompute(self) -> bool:
        return self.execution.recompute.granularity is not None


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
    from the family's per-layer model (exact in fp32 against the measurement) for the workload's
    attention core and recompute granularity.

    One micro-batch is alive without pp (each is backpropagated before the next); with pp, as many
    as the run's schedule keeps alive on the stage (`schedules.in_flight`). Each layer keeps `kept`
    bytes per micro-batch in flight, and with recompute one layer at a time rebuilds its `rebuilt`
    bytes. Under context parallelism a rank holds 1/cp of every sequence, and its ring core keeps what
    the blockwise core keeps for those tokens. Layers may differ (a sliding or a full layer under the
    dense core, dense and MoE layers): each of the stage's layers counts its own, and the stage
    holding the head (the last; the first in DualPipeV's V) its multi-token prediction layers.
    Embedding, head and loss are not included."""
    run = execution_for(layout, 0, workload.execution)
    batch, seq_len = workload.micro_batch, workload.seq_len // layout.cp
    alive = in_flight(resolve_schedule(layout, workload.accumulate_steps), layout.pp, layout.vpp, stage,
                      workload.accumulate_steps)
    layers = [family_of(config).layer_activations(config, run, batch, seq_len, compute_bytes, index)
              for index in range(config.num_hidden_layers)
              if layer_stage(index, config.num_hidden_layers, layout.pp, layout.vpp, layout.dualpipev) == stage]
    if stage == layout.head_stage:
        layers += [layer.activations(run, batch, seq_len, compute_bytes) for _, layer in config.prediction_layers()]
    kept, rebuilt = alive * sum(layer.kept for layer in layers), max(layer.rebuilt for layer in layers)
    return int(kept) + rebuilt


def ring_bytes_per_step(config, layout: Layout, workload: Workload, compute_bytes: int = 4) -> int:
    """Bytes a rank sends around its context-parallel ring in one optimizer step: every attention call
    of its stage's decoder layers, for every micro-batch (forward and backward; a recomputed core
    runs its forward ring again)."""
    if layout.cp == 1:
        return 0
    per_call = ring_traffic_bytes(workload.micro_batch, workload.seq_len // layout.cp,
                                  max(config.num_key_value_heads // layout.tp, 1), config.head_dim, layout.cp, compute_bytes,
                                  forward_passes=2 if workload.recompute else 1)
    layers = max(Counter(layer_stage(index, config.num_hidden_layers, layout.pp, layout.vpp, layout.dualpipev)
                         for index in range(config.num_hidden_layers)).values())  # the busiest stage's
    return layers * workload.accumulate_steps * per_call


def plan_layout(config, layout: Layout, compute_bytes: int = 4, workload: Workload | None = None) -> list[RankShare]:
    """Per (stage, tp rank): parameters and bytes of weights, grads and AdamW states (plus fp32
    master weights when compute is narrower than fp32), as ZeRO partitions them over the sharding
    degree: states from stage1 (experts across sharding ranks over their replicas instead:
    `runtime.expert_sharding`), gradients from stage2, weights from stage3 (whose parameters under
    `--stage3_segment_size`, the norm weights, stay whole: left out here); under LoRA gradients and states
    of the adapters only, the base frozen; with a `workload`, the
    decoder layers' activations too (`decoder_activation_bytes`). Raises the layout's own errors
    when invalid."""
    validate_layout(config, layout)
    if workload:
        layout.check_sequence_length(workload.seq_len)
        check_context_parts(config, layout, workload.seq_len)
    plan = plan_of(config)
    mesh = plan.mesh(layout.pp, layout.vpp, layout.ep, layout.tp, layout.dualpipev)
    counts = np.zeros([layout.pp, layout.tp], dtype=np.int64)
    trained = np.zeros([layout.pp, layout.tp], dtype=np.int64)  # with gradients and states (under LoRA: adapters)
    experts = np.zeros([layout.pp, layout.tp], dtype=np.int64)  # of which experts across sharding ranks
    lora = LoRA.of(config) is not None
    for stage in range(layout.pp):  # expert rank 0's share: every expert rank holds as many experts alike
        for name in plan.held_at(stage, 0, mesh):
            if plan[name].buffer:  # a router's correction bias: no grad, no states
                continue
            counts[stage] += plan[name].local_numel(mesh)
            if lora and not is_adapter(name):  # LoRA's frozen base
                continue
            trained[stage] += plan[name].local_numel(mesh)
            if layout.experts_across_sharding and plan[name].placement.expert is not None:
                experts[stage] += plan[name].local_numel(mesh)
    state_bytes = ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0)
    shard = layout.sharding_degree
    replicas = layout.data_replicas * layout.cp // layout.ep  # what experts across sharding are sharded over
    grad_shards = shard if layout.group_sharded_level else 1  # stage2 and stage3
    weight_shards = shard if layout.sharding_stage == "stage3" else 1
    return [RankShare(stage, tp, int(n), -(-int(n) * compute_bytes // weight_shards),
                      -(-int(trained[stage, tp]) * compute_bytes // grad_shards),
                      -(-int(trained[stage, tp] - experts[stage, tp]) * state_bytes // shard)
                      - (-int(experts[stage, tp]) * state_bytes // replicas),
                      decoder_activation_bytes(config, layout, workload, stage, compute_bytes) if workload else 0)
            for (stage, tp), n in np.ndenumerate(counts)]


def dispatch_bytes_per_step(config, layout: Layout, workload: Workload, compute_bytes: int = 4) -> tuple[int, int]:
    """Bytes a rank sends to the other ranks of its expert group in one optimizer step (the busiest
    stage's MoE layers, every micro-batch): (with balanced routing, in the worst case). Each MoE layer
    sends its tokens' k rows out and back in forward, their gradients in backward, and again in a
    recomputed forward; balanced routing keeps 1/ep of the rows on their own rank, the worst case none.
    The multi-token prediction layers count on the last stage.
    Under sequence parallelism each tp rank exchanges its own positions' rows (`SparseMoE`), under cp
    each cp rank its own part of the sequences. Which
    layers are MoE is each layer's declaration (DeepSeek's and GLM's dense first layers, ERNIE's range)."""
    from modeling.blocks.moe import layer_moe

    if layout.ep == 1:
        return 0, 0
    per_stage = [0] * layout.pp
    for index in range(config.num_hidden_layers):
        if layer_moe(config.decoder_layer(index)) is not None:
            per_stage[layer_stage(index, config.num_hidden_layers, layout.pp, layout.vpp, layout.dualpipev)] += 1
    per_stage[-1] += sum(layer_moe(layer) is not None for _, layer in config.prediction_layers())
    exchanges = 4 + (2 if workload.recompute else 0)
    rows = (workload.micro_batch * workload.seq_len * config.num_experts_per_tok
            // (layout.cp * sequence_shards(layout.tp, layout.sequence_parallel)))
    worst = max(per_stage) * workload.accumulate_steps * exchanges * rows * config.hidden_size * compute_bytes
    return worst * (layout.ep - 1) // layout.ep, worst
