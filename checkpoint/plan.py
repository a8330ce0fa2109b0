"""Will a layout run, and what does each rank hold? Answered from the model config alone, offline."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from checkpoint.format import STATE_SEPARATOR
from modeling.registry import plan_of, validate_layout
from modeling.tp_plan import TensorPlan, stages_holding
from paddle_pp.runtime.layout import Layout

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class RankShare:
    """What every rank at one (pipeline stage, tp rank) holds; dp and sharding ranks repeat it."""

    stage: int
    tp_rank: int
    parameters: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def tensor_stages(plan: dict[str, TensorPlan], name: str, config, layout: Layout) -> list[int]:
    """The pipeline stages holding tensor `name` of a checkpoint (an optimizer state goes with its parameter)."""
    return stages_holding(plan[name.split(STATE_SEPARATOR)[0]], config.num_hidden_layers, layout.pp, layout.vpp)


def plan_layout(config, layout: Layout, compute_bytes: int = 4) -> list[RankShare]:
    """Per (stage, tp rank): parameters and bytes of weights, grads and AdamW states (sharded over
    the sharding degree; plus fp32 master weights when compute is narrower than fp32). Activations
    depend on batch and sequence and are not included. Raises the layout's own errors when invalid."""
    validate_layout(config, layout)
    plan = plan_of(config)
    counts = np.zeros([layout.pp, layout.tp], dtype=np.int64)
    for name, row in plan.items():
        numel = int(np.prod(row.shape))
        for stage in tensor_stages(plan, name, config, layout):
            counts[stage] += numel // layout.tp if row.tp_axis is not None else numel
    state_bytes = ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0)
    return [RankShare(stage, tp, int(n), int(n) * compute_bytes, int(n) * compute_bytes,
                      -(-int(n) * state_bytes // layout.sharding_degree))
            for (stage, tp), n in np.ndenumerate(counts)]
