"""The placement plan: every single-card parameter's placement on each axis of the mesh, collected
from what the blocks declare.

No family writes this table: each block declares its parts (`modeling/blocks/parts.py`), and
`ModelFamily.tensor_plan` walks the declarations. The TP model, the pipeline split, the checkpoint
(which knows models only through a `ModelPlan`), the planner and the transformers adapter all read
it. Paddle linears store weights as [in, out]: a column-parallel linear splits axis 1 (and its
bias), a row-parallel one axis 0; an embedding splits its vocabulary rows.

A `Placement` says, per axis, where a tensor is: on which pipeline stages (its place), on which
expert-parallel rank (its expert's), and how tp cuts it. One rule answers every reader from it
(`Placement.held_at`, `Placement.local_shape`, on a `Mesh` of the axes' sizes): which tensors a
rank builds and `check_built` holds it to, which ranks hold a tensor in the save planner, each
sharding rank's partition, the planner's per-rank bytes. The data axes (dp, sharding, cp) place
nothing: their ranks are replicas, except that a data rank's expert rank is `Layout.expert_rank`. A
save needs no placement of its own: it plans its writers from the holdings every rank reports.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache, partial
from typing import Callable, Iterator

import numpy as np

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.experts import local_experts

COLUMN, ROW, REPLICATED = 1, 0, None
VOCAB_ROWS = 0  # an embedding's rows (vocabulary entries) split over tp
VECTOR_SPLIT = 0  # a column-parallel linear's bias
FIRST, LAST, FIRST_AND_LAST = "first", "last", "first_and_last"  # stages of tensors outside the decoder layers
NORMAL, ZEROS, ONES = "normal", "zeros", "ones"  # how a parameter starts (matrices N(0, initializer_range))
KAIMING_UNIFORM = "kaiming_uniform"  # LoRA's A: U(-1/sqrt(in), 1/sqrt(in)) over its [in, r], as PEFT draws it
A_LOG = "a_log"  # log of U(0.01, 16) per head: a recurrent mixer's decay rate A (transformers' Gated DeltaNet)
# A replicated parameter whose gradient each tp rank holds only a part of, summed over tp after backward:
ALWAYS = "always"  # q/k norms: each rank sees only its heads
UNDER_SEQUENCE_PARALLEL = "sequence_parallel"  # norms and row-linear biases: each rank sees its positions


class TPPlanError(UserError, ValueError):
    """A model config that cannot be split over the requested tensor-parallel degree."""


@dataclass(frozen=True)
class Mesh:
    """The sizes of the axes tensors are placed along, for one model under one layout: pipeline
    stages (with vpp chunks each, or DualPipeV's two in a V: `v_shape`), expert-parallel ranks, tp
    ranks; and the model's decoder layers and experts per MoE layer (0: dense), which the stage and
    expert rules divide."""

    num_layers: int
    num_experts: int = 0
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    tp: int = 1
    v_shape: bool = False

    @property
    def last_stage(self) -> int:
        """The stage holding what follows the decoder layers (the final norm, the head): the V turns
        back to the first."""
        return 0 if self.v_shape else self.pp - 1

    def experts_of(self, expert_rank: int) -> range:
        """The global ids of the experts an expert-parallel rank holds (the rule the expert groups
        are built by: `runtime.experts.local_experts`)."""
        return local_experts(self.num_experts, self.ep, expert_rank)

    def positions(self) -> list[tuple[int, int]]:
        """Every (stage, expert rank): between them, the distinct sets of tensors ranks hold."""
        return [(stage, expert_rank) for stage in range(self.pp) for expert_rank in range(self.ep)]


@dataclass(frozen=True)
class Placement:
    """Where a tensor is, per axis: `stage` its place in the pipeline (its decoder layer's index,
    or FIRST / LAST / FIRST_AND_LAST; None inside a block until the model places it), `expert` the
    global id of the MoE expert it belongs to (None: every expert rank holds it), `tp` the axis tp
    splits (None: whole on every tp rank)."""

    tp: int | None
    stage: int | str | None = None
    expert: int | None = None
    tp_units: int | None = None  # the whole heads along `tp` (kv heads): with more tp ranks, each holds it whole

    def tp_axis(self, tp: int) -> int | None:
        """The axis tp splits under degree `tp`: None where every rank holds the tensor whole (replicated,
        or a tensor of `tp_units` heads over more ranks than heads)."""
        return None if self.tp_units is not None and tp > self.tp_units else self.tp

    def stages(self, mesh: Mesh) -> list[int]:
        """The pipeline stages holding it: its decoder layer's (`layer_stage`), or those of its place."""
        if isinstance(self.stage, int):
            return [layer_stage(self.stage, mesh.num_layers, mesh.pp, mesh.vpp, mesh.v_shape)]
        return {FIRST: [0], LAST: [mesh.last_stage], FIRST_AND_LAST: sorted({0, mesh.last_stage})}[self.stage]

    def held_at(self, stage: int, expert_rank: int, mesh: Mesh) -> bool:
        """Whether the ranks of pipeline stage `stage` and expert rank `expert_rank` hold it."""
        return stage in self.stages(mesh) and (self.expert is None or self.expert in mesh.experts_of(expert_rank))

    def local_shape(self, shape, mesh: Mesh) -> tuple[int, ...]:
        """A tp rank's shape of a tensor so placed whose single-card shape is `shape`."""
        return local_shape(shape, self.tp_axis(mesh.tp), mesh.tp)


@dataclass(frozen=True)
class TensorPlan:
    """One single-card parameter: full shape, its `Placement`, whether it is a linear weight ([in,
    out]; torch stores the transpose), how it starts, and when its gradient is summed over tp."""

    shape: tuple[int, ...]
    placement: Placement
    linear: bool = False
    init: str | float = NORMAL  # a number: every element starts at it
    tp_partial_grad: str | None = None
    buffer: bool = False  # a persistent buffer (saved, loaded, resharded), not a parameter: no gradient, no optimizer
    adaptable: bool = False  # a projection LoRA may adapt (not a router, a head or the sparse-attention indexer)

    def placed(self, **axes) -> TensorPlan:
        """This tensor with its placement on the given axes set (`stage=`, `expert=`)."""
        return replace(self, placement=replace(self.placement, **axes))

    def local_numel(self, mesh: Mesh) -> int:
        """Elements of a tp rank's piece."""
        return int(np.prod(self.placement.local_shape(self.shape, mesh)))


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
        """Each parameter's tp axis as declared (None: whole on every tp rank), what an index records."""
        return {name: row.placement.tp for name, row in self.tensors.items()}

    def tp_axes(self, tp: int) -> dict[str, int | None]:
        """Each parameter's tp axis under degree `tp`: how a rank of that degree cuts it (`Placement.tp_axis`)."""
        return {name: row.placement.tp_axis(tp) for name, row in self.tensors.items()}

    def whole_at(self, tp: int) -> frozenset[str]:
        """The parameters declared split over tp that degree `tp` leaves whole on every rank (key/value
        projections with fewer heads than ranks)."""
        return frozenset(name for name, row in self.tensors.items() if row.placement.tp_axis(tp) != row.placement.tp)

    def mesh(self, pp: int = 1, vpp: int = 1, ep: int = 1, tp: int = 1, v_shape: bool = False) -> Mesh:
        """The mesh of this model under those degrees."""
        return Mesh(self.num_layers, self.num_experts, pp, vpp, ep, tp, v_shape)

    def stages(self, name: str, pp: int, vpp: int, v_shape: bool = False) -> list[int]:
        """The pipeline stages holding parameter `name`."""
        return self.tensors[name].placement.stages(self.mesh(pp, vpp, v_shape=v_shape))

    def held_at(self, stage: int, expert_rank: int, mesh: Mesh) -> list[str]:
        """Single-card names the ranks of (stage, expert rank) hold, in the order the built model lists
        its parameters (what stage1's partition goes by): model order for the pipeline's layers, the
        containers' order without pp (`in_container_order`)."""
        names = [name for name, row in self.tensors.items() if row.placement.held_at(stage, expert_rank, mesh)]
        return names if mesh.pp > 1 else in_container_order(names)

    @cached_property
    def num_experts(self) -> int:
        """Experts per MoE layer (0 for a dense model); every stage and holder question reads it."""
        experts = [row.placement.expert for row in self.tensors.values() if row.placement.expert is not None]
        return 1 + max(experts, default=-1)


def in_container_order(names: list[str]) -> list[str]:
    """`names` (in model order) as a Paddle layer built from them lists its parameters: each
    container's contents together, containers in the order they were first added. A multi-token
    prediction layer joins the decoder layers' list, which came before the final norm: its
    parameters are listed before the norm's."""
    first: dict[str, int] = {}
    for index, name in enumerate(names):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:depth]), index)

    def containers(name: str) -> list[int]:
        parts = name.split(".")
        return [first[".".join(parts[:depth])] for depth in range(1, len(parts) + 1)]

    return sorted(names, key=containers)


def initial_values(init: str | float, shape, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """A tensor drawn as its plan's `init` says (a number: filled with it), fp32 (matrices from N(0, `std`))."""
    if isinstance(init, float):
        return np.full(shape, init, np.float32)
    if init == NORMAL:
        return rng.normal(0.0, std, size=shape).astype(np.float32)
    if init == KAIMING_UNIFORM:
        bound = 1.0 / np.sqrt(shape[0])
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)
    if init == A_LOG:
        return np.log(rng.uniform(0.01, 16.0, size=shape)).astype(np.float32)
    return (np.ones if init == ONES else np.zeros)(shape, np.float32)


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


@lru_cache(maxsize=None)  # asked for every tensor a rank may hold: 46 million times planning a 2048-rank save
def chunk_starts(num_layers: int, chunks: int) -> tuple[int, ...]:
    """The first decoder layer of each of `chunks` pipeline chunks, then `num_layers`: an equal share
    each, and when they do not divide, one more each for the chunks after the first, in order, so
    the first chunk (which also holds the embedding) keeps the fewer, and so does the last (the head
    and loss) unless every other chunk needs one more (DeepSeek-V3's 61 layers over 16 stages: 3,
    thirteen of 4, then 3 and 3)."""
    share, extra = divmod(num_layers, chunks)
    starts = [0]
    for chunk in range(chunks):
        starts.append(starts[-1] + share + (1 if 1 <= chunk <= extra else 0))
    return tuple(starts)


def pipeline_chunks(pp: int, vpp: int, v_shape: bool = False) -> int:
    """How many chunks the decoder layers are cut into: vpp per stage, or DualPipeV's two."""
    return pp * (2 if v_shape else vpp)


def chunk_stage(chunk: int, pp: int, v_shape: bool = False) -> int:
    """The stage of pipeline chunk `chunk`: interleaved, chunk c on stage c % pp; in DualPipeV's V,
    the first pp chunks down the stages and the next pp back up (fleet's `_segment_network_for_dualpipev`)."""
    if v_shape:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def layer_stage(index: int, num_layers: int, pp: int, vpp: int, v_shape: bool = False) -> int:
    """The pipeline stage of decoder layer `index`: it lives in the chunk `chunk_starts` places it in,
    on that chunk's stage."""
    chunks = pipeline_chunks(pp, vpp, v_shape)
    return chunk_stage(bisect.bisect_right(chunk_starts(num_layers, chunks), index) - 1, pp, v_shape)


def check_divisible(architecture: str, units: dict[str, int], tp: int) -> None:
    """Fail before any weight is built when a unit TP splits (by its config field's name) does not
    divide by `tp`."""
    for name, value in units.items():
        if value % tp:
            raise TPPlanError(
                f"{architecture} {name}={value} is not divisible by --tensor_parallel_degree {tp}; "
                f"choose a degree that divides it{' (or pad the vocabulary)' if name == 'vocab_size' else ''}.")


def check_shared(architecture: str, units: dict[str, int], tp: int) -> None:
    """Fail before any weight is built when a unit TP splits or, with more ranks than units, gives
    each rank whole (key/value heads) neither divides by `tp` nor divides it: a rank's query heads
    would use more than one of them, or one split between ranks."""
    for name, value in units.items():
        if value % tp and tp % value:
            raise TPPlanError(
                f"{architecture} {name}={value} neither divides by nor divides --tensor_parallel_degree {tp}; "
                f"choose a degree that is a multiple or a divisor of {value}")


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
