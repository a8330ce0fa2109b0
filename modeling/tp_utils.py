"""Split and merge single-card tensors by a TP plan (name -> axis), shared by every model family."""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

import numpy as np


class TPPlanError(ValueError):
    """A model config that cannot be split over the requested tensor-parallel degree."""


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
