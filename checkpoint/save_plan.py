"""What a save of a model writes under a layout, who holds each tensor, and how long it takes:
answered from the model's plan alone, offline (`tools/reshard.py plan`), with the writers the save
itself would choose (`writers.assign_writers`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR
from checkpoint.optimizer_state import MASTER_WEIGHT
from checkpoint.writers import Slot, WriteItem, WritePlan, gathered_bytes, sharding_owners, stage2_owners
from modeling.tp_plan import ModelPlan, local_shape
from paddle_pp.runtime.experts import local_experts
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
    stage3 every sharding rank holds a slice, so every replica can write it). Under expert
    parallelism an expert's tensors are held by the dp ranks of its expert rank only, and each
    expert rank's sharding partition is over its own parameters (the same shapes on every one)."""
    items: list[WriteItem] = []
    states = OPTIMIZER_STATES + ((MASTER_WEIGHT,) if compute_bytes < 4 else ())
    position = {name: i for i, name in enumerate(plan)}
    for stage in range(layout.pp):
        for expert_rank in range(layout.ep):
            experts = local_experts(plan.num_experts, layout.ep, expert_rank)
            names = sorted(plan.rank_names(stage, layout.pp, layout.vpp, experts), key=position.__getitem__)
            numels = [int(np.prod(local_shape(plan[n].shape, plan[n].tp_axis, layout.tp))) for n in names]
            owners = (stage2_owners if layout.sharding_stage == "stage2" else sharding_owners)(
                numels, layout.sharding_degree)
            for name, owner in zip(names, owners):
                if plan[name].expert is None and expert_rank > 0:
                    continue  # a dense tensor: listed with expert rank 0, held by every dp rank
                dps = [dp for dp in range(layout.dp) if plan[name].expert is None or layout.expert_rank(dp) == expert_rank]
                items += _tensor_items(plan, name, layout, stage, owner, dps, states)
    return items


def _tensor_items(plan: ModelPlan, name: str, layout: Layout, stage: int, owner: int, dps: list[int],
                  states: tuple[str, ...]) -> list[WriteItem]:
    """A parameter's write items: held by the replicas of dp ranks `dps`, its states by their sharding rank `owner`."""
    row, numel = plan[name], int(np.prod(plan[name].shape))
    split = row.tp_axis is not None and layout.tp > 1
    # stage3 slices every parameter over the segment size, which the planner does not know: all are counted
    gathered = gathered_bytes(numel * 4, split, layout.tp,
                              layout.sharding_degree if layout.sharding_stage == "stage3" else 1)
    holding = tuple((stage, layout.weight_replica(dp, s, cp)) for cp in range(layout.cp) for dp in dps
                    for s in range(layout.sharding_degree))
    holders = holding if layout.sharding_stage == "stage3" else \
        tuple((stage, layout.weight_replica(dp, owner, cp)) for cp in range(layout.cp) for dp in dps)
    return [WriteItem(MODEL, name, numel * 4, split, gathered, tuple(sorted(holding))),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", numel * 4, split, gathered, holders)
              for state in states),
            *(WriteItem(OPTIMIZER, f"{name}{STATE_SEPARATOR}{state}", 4, False, 0, holders)
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
