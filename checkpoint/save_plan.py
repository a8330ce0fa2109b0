"""What a save of a model writes under a layout, who holds each tensor, and how long it takes:
answered from the model's plan alone, offline (`tools/reshard.py plan`), with the writers the save
itself would choose (`writers.assign_writers`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR
from checkpoint.optimizer_state import MASTER_WEIGHT
from checkpoint.writers import Slot, WriteItem, WritePlan, gathered_bytes
from modeling.placement import ModelPlan
from paddle_pp.runtime.layout import Layout
from paddle_pp.runtime.partitions import sharding_owners, stage2_owners


def tensor_stages(plan: ModelPlan, name: str, layout: Layout) -> list[int]:
    """The pipeline stages holding tensor `name` of a checkpoint (an optimizer state goes with its parameter)."""
    return plan.stages(name.split(STATE_SEPARATOR)[0], layout.pp, layout.vpp, layout.dualpipev)


OPTIMIZER_STATES = ("moment1", "moment2")  # AdamW's fp32 moments, one of each per parameter
OPTIMIZER_SCALARS = ("beta1_pow_acc", "beta2_pow_acc")  # one fp32 number each per parameter


def save_items(plan: ModelPlan, layout: Layout, compute_bytes: int = 4) -> list[WriteItem]:
    """What a save of this model under `layout` writes, and who holds each tensor: the model in
    fp32, AdamW's states (and fp32 master weights under bf16/fp16), each parameter's states held by
    the sharding rank Paddle's stage1 or stage2 optimizer gives it, in every dp and cp replica (under
    stage3 every sharding rank holds a slice, so every replica can write it); a buffer (an MoE
    router's correction bias) is written with the model only and is not in the optimizer's
    partition. The tensors of a (stage, expert rank) are its placement's (`Placement.held_at`),
    held by the data ranks of that expert rank (`Layout.expert_rank`). Paddle partitions a rank's
    own parameters over sharding, so when ep divides dp each expert rank's partition is over its own
    (the same shapes on every one); with experts across sharding ranks the partition is over the
    dense parameters and the experts' over their replicas (`runtime.expert_sharding`)."""
    states = OPTIMIZER_STATES + ((MASTER_WEIGHT,) if compute_bytes < 4 else ())
    mesh = plan.mesh(layout.pp, layout.vpp, layout.ep, layout.tp, layout.dualpipev)
    holding: dict[str, set] = defaultdict(set)  # (stage, dp, sharding, cp) of every rank holding the tensor
    updating: dict[str, set] = defaultdict(set)  # the same for its optimizer states
    for stage, expert_rank in mesh.positions():
        held = plan.held_at(stage, expert_rank, mesh)
        own = [name for name in held if layout.experts_across_sharding and plan[name].placement.expert is not None]
        partitioned = [name for name in held if not plan[name].buffer and name not in own]
        owners = dict(zip(partitioned, (stage2_owners if layout.sharding_stage == "stage2" else sharding_owners)(
            [plan[name].local_numel(mesh) for name in partitioned], layout.sharding_degree)))
        # in global rank order, which is the replicas' group order (dp, then sharding, then cp)
        ranks = [(dp, s, cp) for dp in range(layout.dp) for s in range(layout.sharding_degree)
                 for cp in range(layout.cp) if layout.expert_rank(dp, s) == expert_rank]
        replica = dict(zip(own, sharding_owners([plan[name].local_numel(mesh) for name in own], len(ranks))))
        for name in held:
            holding[name] |= {(stage, *rank) for rank in ranks}
            if name in replica:
                updating[name].add((stage, *ranks[replica[name]]))
            elif not plan[name].buffer:
                updating[name] |= {(stage, dp, owners[name], cp) for dp, _, cp in ranks}
    return [item for name in holding
            for item in _tensor_items(plan, name, layout, holding[name], updating[name], states)]


def _tensor_items(plan: ModelPlan, name: str, layout: Layout, holding: set, updating: set,
                  states: tuple[str, ...]) -> list[WriteItem]:
    """A parameter's write items: its weights held by the (stage, dp, sharding, cp) ranks `holding`,
    its states by `updating` (by `holding` under stage3, which slices them all)."""
    row, numel = plan[name], int(np.prod(plan[name].shape))
    split = row.placement.tp_axis(layout.tp) is not None and layout.tp > 1
    # stage3 slices every parameter over the segment size, which the planner does not know: all are counted
    gathered = gathered_bytes(numel * 4, split, layout.tp,
                              layout.sharding_degree if layout.sharding_stage == "stage3" else 1)

    def slots(ranks: set) -> tuple:
        return tuple(sorted({(stage, layout.weight_replica(dp, s, cp)) for stage, dp, s, cp in ranks}))

    held = slots(holding)
    if row.buffer:  # saved with the model, never updated by the optimizer
        return [WriteItem(MODEL, name, numel * 4, split, gathered, held)]
    updated = held if layout.sharding_stage == "stage3" else slots(updating)
    return [WriteItem(MODEL, name, numel * 4, split, gathered, held),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", numel * 4, split, gathered, updated)
              for state in states),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", 4, False, 0, updated)
              for state in OPTIMIZER_SCALARS)]


@dataclass(frozen=True)
class SaveEstimate:
    """A save's cost from per-rank write and receive bandwidths (GB/s), and the shared file
    system's aggregate write bandwidth when it is the tighter bound."""

    max_write_bytes: int
    mean_write_bytes: float
    max_received_bytes: int
    seconds: float

    @property
    def balance(self) -> float:
        return self.max_write_bytes / self.mean_write_bytes if self.mean_write_bytes else 1.0


def estimate_save(plan: WritePlan, slots: list[Slot], disk_gbps: float, link_gbps: float,
                  fs_gbps: float | None = None) -> SaveEstimate:
    """Ranks write in parallel, each gathering then writing its share; the save takes as long as the
    slowest rank, or as the file system takes to absorb every byte, whichever is longer."""
    written = [plan.written.get(slot, 0) for slot in slots]
    received = [plan.received.get(slot, 0) for slot in slots]
    per_rank = max(w / (disk_gbps * 1e9) + r / (link_gbps * 1e9) for w, r in zip(written, received))
    shared = sum(written) / (fs_gbps * 1e9) if fs_gbps else 0.0
    return SaveEstimate(max(written), sum(written) / len(written), max(received), max(per_rank, shared))
