"""The shape of a TP plan, shared by every model family: one row per single-card parameter saying
its shape, how tensor parallelism splits it, and which pipeline stage holds it.

Each family writes one table (`<family>/tp_plan.py::tensor_plan`); split axes, single-card shapes,
per-rank shapes and pipeline placement are all read from it, so nothing else in the code base
matches parameter names. Paddle linears store weights as [in, out]: a column-parallel linear splits
axis 1 (and its bias), a row-parallel one axis 0; an embedding splits its vocabulary rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping

import numpy as np

from paddle_pp.runtime.errors import UserError

COLUMN, ROW, REPLICATED = 1, 0, None
VOCAB_ROWS = 0  # an embedding's rows (vocabulary entries) split over tp
VECTOR_SPLIT = 0  # a column-parallel linear's bias
FIRST, LAST, FIRST_AND_LAST = "first", "last", "first_and_last"  # stages of tensors outside the decoder layers


class TPPlanError(UserError, ValueError):
    """A model config that cannot be split over the requested tensor-parallel degree."""


@dataclass(frozen=True)
class TensorPlan:
    """One single-card parameter: full shape, TP split axis (None: replicated), where it lives in the
    pipeline (its decoder layer's index, or FIRST / LAST / FIRST_AND_LAST), and whether it is a
    linear weight (transformers stores those transposed)."""

    shape: tuple[int, ...]
    tp_axis: int | None
    place: int | str
    linear: bool = False


Plan = Mapping[str, TensorPlan]


def split_axes(plan: Plan) -> dict[str, int | None]:
    return {name: row.tp_axis for name, row in plan.items()}


def single_card_shapes(plan: Plan) -> dict[str, tuple[int, ...]]:
    return {name: row.shape for name, row in plan.items()}


def local_shape(shape, axis: int | None, tp: int) -> tuple[int, ...]:
    """A tp rank's shape of a tensor whose single-card shape is `shape`."""
    shape = list(shape)
    if axis is not None and tp > 1:
        shape[axis] //= tp
    return tuple(shape)


def single_card_shape(local, axis: int | None, tp: int) -> list[int]:
    """The full shape of a tensor whose tp slice has shape `local` (split along `axis`, if any)."""
    shape = list(local)
    if axis is not None and tp > 1:
        shape[axis] *= tp
    return shape


def stages_holding(row: TensorPlan, num_layers: int, pp: int, vpp: int) -> list[int]:
    """The pipeline stages that hold a tensor. Decoder layer i lives in virtual chunk
    i // (layers per chunk), and chunk c on stage c % pp (interleaved order)."""
    if isinstance(row.place, int):
        return [row.place // (num_layers // (pp * vpp)) % pp]
    return {FIRST: [0], LAST: [pp - 1], FIRST_AND_LAST: sorted({0, pp - 1})}[row.place]


def check_divisible(family: str, config, fields: tuple[str, ...], tp: int) -> None:
    """Fail before any weight is built when a dimension that TP splits does not divide by `tp`."""
    for field in fields:
        value = getattr(config, field)
        if value % tp:
            raise TPPlanError(
                f"{family} {field}={value} is not divisible by --tensor_parallel_degree {tp}; "
                f"choose a degree that divides it{' (or pad the vocabulary)' if field == 'vocab_size' else ''}."
            )


def split_tensor(full: np.ndarray, axis: int | None, tp: int, rank: int) -> np.ndarray:
    if axis is None or tp == 1:
        return full
    if full.shape[axis] % tp:
        raise TPPlanError(f"axis {axis} of a tensor shaped {list(full.shape)} does not split into {tp} parts")
    return np.split(full, tp, axis=axis)[rank]


def merge_tensors(parts: list[np.ndarray], axis: int | None) -> np.ndarray:
    return parts[0] if axis is None else np.concatenate(parts, axis=axis)


def tensor_parallel_mappings(axes: Mapping[str, int | None], is_split: bool, tp: int, rank: int) -> dict[str, Callable]:
    """PaddleNLP's `_get_tensor_parallel_mappings` contract: name -> split (one tensor) or merge (a list)."""
    mappings = {}
    for name, axis in axes.items():
        if axis is None:
            continue
        mappings[name] = partial(split_tensor, axis=axis, tp=tp, rank=rank) if is_split else partial(merge_tensors, axis=axis)
    return mappings
