"""Single-card weights in memory into any layout and back: each rank takes its slice of every
tensor (drawn at initialisation, or given); gathering rebuilds the whole (tests and tools).

Every rank sees its parameters under single-card names (`state_dict()` of both the TP model and the
pipeline model), so the model family's TP plan (name -> split axis) is all that is needed.
"""

from __future__ import annotations

import zlib
from typing import Callable, Collection, Mapping

import numpy as np
import paddle.distributed as dist

from modeling.placement import ModelPlan, initial_values, merge_tensors, single_card_shape, split_tensor
from paddle_pp.runtime.topology import Topology, gather_objects


class TiedWeightError(RuntimeError):
    """Copies of one tied weight on different pipeline stages that have drifted apart."""


def _assign_slices(model, axes: Mapping[str, int | None], topo: Topology,
                   full_tensor: Callable[[str, list[int]], np.ndarray], names: Collection[str] | None = None) -> None:
    """Set every local parameter (of `names`, when given) to its tp slice of `full_tensor(name,
    single_card_shape)`, one tensor at a time, so at most one full tensor is held beyond the model itself."""
    for name, param in model.state_dict().items():
        if names is not None and name not in names:
            continue
        axis = axes.get(name)
        full_shape = single_card_shape(param.shape, axis, topo.layout.tp)
        local = split_tensor(np.asarray(full_tensor(name, full_shape)), axis, topo.layout.tp, topo.tp_rank)
        if list(local.shape) != list(param.shape):
            raise ValueError(f"{name}: slice shaped {list(local.shape)} does not fit parameter {list(param.shape)}")
        param.set_value(local.astype(np.float32) if local.dtype == np.float64 else local)


def load_single_card_state(model, full_state: Mapping[str, np.ndarray], axes: Mapping[str, int | None],
                           topo: Topology) -> None:
    """Set every local parameter to its tp slice of `full_state`; a missing or misshapen tensor is an error."""

    def lookup(name: str, _shape: list[int]) -> np.ndarray:
        if name not in full_state:
            raise KeyError(f"single-card state has no tensor {name!r} that this model needs")
        return full_state[name]

    _assign_slices(model, axes, topo, lookup)


def assign_single_card(model, arrays: Mapping[str, np.ndarray], axes: Mapping[str, int | None],
                       topo: Topology) -> None:
    """Set the parameters `arrays` names (single-card tensors) to this rank's tp slices of them."""
    _assign_slices(model, axes, topo, lambda name, _shape: arrays[name], arrays.keys())


def init_single_card_weights(model, plan: ModelPlan, topo: Topology, seed: int, std: float,
                             names: Collection[str] | None = None) -> None:
    """Initialise every parameter (of `names`, when given: those a pretrained folder does not hold) as
    the single-card model would be, whatever the layout.

    Each tensor is drawn from its own generator keyed by (seed, single-card name), as its plan says:
    matrices from N(0, std), vectors zeros or ones (biases, norm scales; a `1 + weight` norm's zeros)
    or a recurrent mixer's decay rates.
    TP ranks slice the same full tensor and pipeline stages draw only their own, so every layout
    starts from bit-identical weights (fleet's own per-layer seeding differs between layouts)."""

    def draw(name: str, shape: list[int]) -> np.ndarray:
        return initial_values(plan[name].init, shape, np.random.default_rng([seed, zlib.crc32(name.encode())]), std)

    _assign_slices(model, plan.tp_axes(topo.layout.tp), topo, draw, names)


def gather_single_card_state(model, axes: Mapping[str, int | None], topo: Topology) -> dict[str, np.ndarray]:
    """The full single-card state dict, assembled on every rank (tests and tools; small models only).

    A weight held by several stages (a tied embedding) appears once, after checking the copies are
    bit-identical."""
    local: dict[str, np.ndarray] = {}
    for name, param in model.state_dict().items():
        axis = axes.get(name)
        if axis is None or topo.layout.tp == 1:
            local[name] = param.numpy()
            continue
        parts: list = []
        dist.all_gather(parts, param.detach(), group=topo.tp_group)
        local[name] = merge_tensors([p.numpy() for p in parts], axis)
    merged: dict[str, np.ndarray] = {}
    for stage in gather_objects(local, topo.pp_group, topo.layout.pp):
        for name, value in stage.items():
            if name in merged and not np.array_equal(merged[name], value):
                raise TiedWeightError(f"{name}: the copies held by different pipeline stages differ "
                                      f"(max |diff| {np.abs(merged[name] - value).max():.3g}); tied weights must stay identical")
            merged[name] = value
    return merged
