"""What a save of a model writes under a layout, who holds each tensor, and how long it takes:
answered from the model's plan alone, offline (`tools/reshard.py plan`), with the writers the save
itself would choose (`writers.assign_writers`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR
from checkpoint.optimizer_state import MASTER_WEIGHT
from checkpoint.writers import Slot, WriteItem, WritePlan, gathered_bytes, sharding_owners, stage2_owners
from modeling.tp_plan import ModelPlan
from paddle_pp.runtime.layout import Layout


def tensor_stages(plan: ModelPlan, name: str, layout: Layout) -> list[int]:
    """The pipeline stages holding tensor `name` of a checkpoint (an optimizer state goes with its parameter)."""
    return plan.stages(name.split(STATE_SEPARATOR)[0], layout.pp, layout.vpp)


OPTIMIZER_STATES = ("moment1", "moment2")  # AdamW's fp32 moments, one of each per parameter
OPTIMIZER_SCALARS = ("beta1_pow_acc", "beta2_pow_acc")  # one fp32 number each per parameter


def save_items(plan: ModelPlan, layout: Layout, compute_bytes: int = 4) -> list[WriteItem]:
    """What a save of this model under `layout` writes, and who holds each tensor: the model in
    fp32, AdamW's states (and fp32 master weights under bf16/fp16), each parameter's states held by
    the sharding rank Paddle's stage1 or stage2 optimizer gives it, in every dp and cp replica (under
    stage3 every sharding rank holds a slice, so every replica can write it); a buffer (an MoE
    router's correction bias) is written with the model only and is not in the optimizer's
    partition. The tensors of a
    (stage, expert rank) are its placement's (`Placement.held_at`); Paddle partitions a rank's own
    parameters over sharding, so each expert rank's partition is over its own (the same shapes on
    every one), and an expert's tensors are held by the dp ranks of its expert rank only."""
    states = OPTIMIZER_STATES + ((MASTER_WEIGHT,) if compute_bytes < 4 else ())
    mesh = plan.mesh(layout.pp, layout.vpp, layout.ep, layout.tp)
    holders: dict[str, set] = defaultdict(set)  # one entry per tensor, however many (stage, expert rank) hold it
    for stage, expert_rank in mesh.positions():
        held = plan.held_at(stage, expert_rank, mesh)
        names = [name for name in held if not plan[name].buffer]  # what the optimizer partitions
        owners = (stage2_owners if layout.sharding_stage == "stage2" else sharding_owners)(
            [plan[name].local_numel(mesh) for name in names], layout.sharding_degree)
        dps = [dp for dp in range(layout.dp) if layout.expert_rank(dp) == expert_rank]
        for name, owner in [*zip(names, owners), *((name, 0) for name in held if plan[name].buffer)]:
            holders[name] |= {(stage, dp, owner) for dp in dps}
    return [item for name, held in holders.items() for item in _tensor_items(plan, name, layout, sorted(held), states)]


def _tensor_items(plan: ModelPlan, name: str, layout: Layout, holders: list[tuple[int, int, int]],
                  states: tuple[str, ...]) -> list[WriteItem]:
    """A parameter's write items: held by the replicas of its (stage, dp rank, sharding owner) `holders`."""
    row, numel = plan[name], int(np.prod(plan[name].shape))
    split = row.placement.tp is not None and layout.tp > 1
    # stage3 slices every parameter over the segment size, which the planner does not know: all are counted
    gathered = gathered_bytes(numel * 4, split, layout.tp,
                              layout.sharding_degree if layout.sharding_stage == "stage3" else 1)
    holding = tuple(sorted({(stage, layout.weight_replica(dp, s, cp)) for stage, dp, _ in holders
                            for cp in range(layout.cp) for s in range(layout.sharding_degree)}))
    updating = holding if layout.sharding_stage == "stage3" else \
        tuple(sorted({(stage, layout.weight_replica(dp, owner, cp)) for stage, dp, owner in holders
                      for cp in range(layout.cp)}))
    if row.buffer:  # saved with the model, never updated by the optimizer
        return [WriteItem(MODEL, name, numel * 4, split, gathered, holding)]
    return [WriteItem(MODEL, name, numel * 4, split, gathered, holding),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", numel * 4, split, gathered, updating)
              for state in states),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", 4, False, 0, updating)
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
