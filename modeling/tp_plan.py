"""The TP plan: every single-card parameter's placement, collected from what the blocks declare.

No family writes this table: each block declares its parts (`modeling/blocks/parts.py`), and
`ModelFamily.tensor_plan` walks the declarations. The TP model, the pipeline split, the checkpoint
(which knows models only through a `ModelPlan`), the planner and the transformers adapter all read
it. Paddle linears store weights as [in, out]: a column-parallel linear splits axis 1 (and its
bias), a row-parallel one axis 0; an embedding splits its vocabulary rows.

A placement says how a tensor is cut over the mesh (over tp, along one axis), which pipeline stage
holds it, and, for an expert's tensor, its global expert id: under expert parallelism only the
ranks holding that expert build it (`ModelPlan.rank_names`); the save plans its writers from the
holdings every rank reports, so it needs no new code for a tensor held by fewer replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import numpy as np

from paddle_pp.runtime.errors import UserError

COLUMN, ROW, REPLICATED = 1, 0, None
VOCAB_ROWS = 0  # an embedding's rows (vocabulary entries) split over tp
VECTOR_SPLIT = 0  # a column-parallel linear's bias
FIRST, LAST, FIRST_AND_LAST = "first", "last", "first_and_last"  # stages of tensors outside the decoder layers
NORMAL, ZEROS, ONES = "normal", "zeros", "ones"  # how a parameter starts (matrices N(0, initializer_range))
# A replicated parameter whose gradient each tp rank holds only a part of, summed over tp after backward:
ALWAYS = "always"  # q/k norms: each rank sees only its heads
UNDER_SEQUENCE_PARALLEL = "sequence_parallel"  # norms and row-linear biases: each rank sees its positions


class TPPlanError(UserError, ValueError):
    """A model config that cannot be split over the requested tensor-parallel degree."""


@dataclass(frozen=True)
class TensorPlan:
    """One single-card parameter: full shape, TP split axis (None: replicated), where it lives in the
    pipeline (its decoder layer's index, or FIRST / LAST / FIRST_AND_LAST; None inside a block until
    the model places it), whether it is a linear weight ([in, out]; torch stores the transpose), how
    it starts, and when its gradient is summed over tp."""

    shape: tuple[int, ...]
    tp_axis: int | None
    place: int | str | None = None
    linear: bool = False
    init: str = NORMAL
    tp_partial_grad: str | None = None
    expert: int | None = None  # the global id of the MoE expert it belongs to (split over expert parallelism)


@dataclass(frozen=True)
class ModelPlan(Mapping):
    """What the checkpoint, the planner and the tools know of a model: its family's names, its
    decoder layers, every parameter's `TensorPlan` (a mapping by single-card name), and which names
    denote one tensor (a tied embedding and head; the stored name first)."""

    model_type: str
    architecture: str
    num_layers: int
    tensors: Mapping[str, TensorPlan]
    tied: tuple[tuple[str, ...], ...] = field(default=())

    def __getitem__(self, name: str) -> TensorPlan:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def axes(self) -> dict[str, int | None]:
        return {name: row.tp_axis for name, row in self.tensors.items()}

    def stages(self, name: str, pp: int, vpp: int) -> list[int]:
        """The pipeline stages holding parameter `name`."""
        return stages_holding(self.tensors[name], self.num_layers, pp, vpp)

    def stage_names(self, stage: int, pp: int, vpp: int) -> set[str]:
        """Single-card names pipeline stage `stage` holds."""
        return {name for name in self.tensors if stage in self.stages(name, pp, vpp)}

    def rank_names(self, stage: int, pp: int, vpp: int, experts: range | None = None) -> set[str]:
        """Single-card names a rank of pipeline stage `stage` holds: of the experts, only those in
        `experts` (its share under expert parallelism; None: all)."""
        return {name for name in self.stage_names(stage, pp, vpp)
                if experts is None or self.tensors[name].expert is None or self.tensors[name].expert in experts}

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0 for a dense model)."""
        return 1 + max((row.expert for row in self.tensors.values() if row.expert is not None), default=-1)


def split_axes(plan: Mapping[str, TensorPlan]) -> dict[str, int | None]:
    return {name: row.tp_axis for name, row in plan.items()}


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


def layer_stage(index: int, num_layers: int, pp: int, vpp: int) -> int:
    """The pipeline stage of decoder layer `index`: it lives in virtual chunk index // (layers per
    chunk), and chunk c on stage c % pp (interleaved order)."""
    return index // (num_layers // (pp * vpp)) % pp


def stages_holding(row: TensorPlan, num_layers: int, pp: int, vpp: int) -> list[int]:
    """The pipeline stages that hold a tensor: its decoder layer's (`layer_stage`), or those of its place."""
    if isinstance(row.place, int):
        return [layer_stage(row.place, num_layers, pp, vpp)]
    return {FIRST: [0], LAST: [pp - 1], FIRST_AND_LAST: sorted({0, pp - 1})}[row.place]


def check_divisible(architecture: str, config, fields: tuple[str, ...], tp: int) -> None:
    """Fail before any weight is built when a dimension that TP splits does not divide by `tp`."""
    for name in fields:
        value = getattr(config, name)
        if value % tp:
            raise TPPlanError(
                f"{architecture} {name}={value} is not divisible by --tensor_parallel_degree {tp}; "
                f"choose a degree that divides it{' (or pad the vocabulary)' if name == 'vocab_size' else ''}.")


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
