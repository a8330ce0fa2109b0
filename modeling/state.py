"""Move weights between single-card form and any layout: each rank loads its slice; gathering rebuilds the whole.

Every rank sees its parameters under single-card names (`state_dict()` of both the TP model and the
pipeline model), so the model family's TP plan (name -> split axis) is all that is needed.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import paddle.distributed as dist

from modeling.tp_utils import merge_tensors, split_tensor
from paddle_pp.topology import Topology


def load_single_card_state(model, full_state: Mapping[str, np.ndarray], axes: Mapping[str, int | None],
                           topo: Topology) -> None:
    """Set every local parameter to its tp slice of `full_state`; a missing or misshapen tensor is an error."""
    for name, param in model.state_dict().items():
        if name not in full_state:
            raise KeyError(f"single-card state has no tensor {name!r} that this model needs")
        local = split_tensor(np.asarray(full_state[name]), axes.get(name), topo.layout.tp, topo.tp_rank)
        if list(local.shape) != list(param.shape):
            raise ValueError(f"{name}: slice shaped {list(local.shape)} does not fit parameter {list(param.shape)}")
        param.set_value(local.astype(np.float32) if local.dtype == np.float64 else local)


def gather_single_card_state(model, axes: Mapping[str, int | None], topo: Topology) -> dict[str, np.ndarray]:
    """The full single-card state dict, assembled on every rank (tests and tools; small models only)."""
    local: dict[str, np.ndarray] = {}
    for name, param in model.state_dict().items():
        axis = axes.get(name)
        if axis is None or topo.layout.tp == 1:
            local[name] = param.numpy()
            continue
        parts: list = []
        dist.all_gather(parts, param.detach(), group=topo.tp_group)
        local[name] = merge_tensors([p.numpy() for p in parts], axis)
    if topo.layout.pp == 1:
        return local
    stages: list = []
    dist.all_gather_object(stages, local, group=topo.pp_group)
    return {name: value for stage in stages for name, value in stage.items()}
