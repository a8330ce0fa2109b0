"""What a block is made of, declared once: each part is a value with its arguments, says its
parameters' plans (shape, tp placement, initial values, whether the gradient is partial per tp rank)
and builds its layer; the model adds the stage placement and the experts block the expert one
(`placement.Placement`).

A leaf (a linear, an embedding, a norm) builds one Paddle layer. A block declaration (`Declared`)
names its parts and the `Block` class it builds; the block's `__init__` builds each part as the
child of that name for the run's `Execution` (single card, or fleet's parallel layers under TP), and
`tensors()` collects the parts' placements under the same names. So a model's TP plan is read off
the declarations its layers are built from, never kept by hand, and does not depend on how a run
computes it; and a layer that differs by its place (its window, its rotary, dense or sparse) is a
declaration with other arguments, not another class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import paddle
from paddle import nn

from modeling import tp_gradients, tp_layers
from modeling.blocks.norms import GroupRMSNorm, RMSNorm, SplitRMSNorm
from modeling.execution import Execution
from modeling.placement import (
    ALWAYS,
    COLUMN,
    ONES,
    REPLICATED,
    ROW,
    UNDER_SEQUENCE_PARALLEL,
    VECTOR_SPLIT,
    VOCAB_ROWS,
    ZEROS,
    Placement,
    TensorPlan,
)


class Part(Protocol):
    """A piece of a model: its parameters' plans under their names, the layer it builds, and the
    units tensor parallelism splits (each must divide by tp)."""

    def tensors(self) -> dict[str, TensorPlan]: ...

    def build(self, config, run: Execution) -> nn.Layer: ...

    def tp_units(self) -> dict[str, int]: ...

    def tp_shared_units(self) -> dict[str, int]: ...


class Leaf:
    """A part that builds one layer and splits no unit of its own."""

    def tp_units(self) -> dict[str, int]:
        return {}

    def tp_shared_units(self) -> dict[str, int]:
        return {}


class Declared:
    """A block's declaration: its named parts (`parts`) and the `Block` class built from it (`layer`)."""

    layer: ClassVar[type[Block]]

    def parts(self) -> dict[str, Part]:
        raise NotImplementedError

    def built_parts(self, run: Execution) -> dict[str, Part]:
        """The parts this rank builds: all of them, unless the run holds only a share (experts under
        expert parallelism)."""
        return self.parts()

    def own_tp_units(self) -> dict[str, int]:
        """Units this block's own code splits over tp (heads, MLP width)."""
        return {}

    def own_tp_shared_units(self) -> dict[str, int]:
        """Units this block's own code splits over tp or, with more tp ranks than units, gives each rank
        whole (key/value heads: `ColumnLinear.heads`)."""
        return {}

    def tensors(self) -> dict[str, TensorPlan]:
        """Every parameter's plan under its name in the block (a part that is one parameter: its own)."""
        return {f"{name}.{key}" if key else name: row for name, part in self.parts().items()
                for key, row in part.tensors().items()}

    def tp_units(self) -> dict[str, int]:
        units = dict(self.own_tp_units())
        for part in self.parts().values():
            units |= part.tp_units()
        return units

    def tp_shared_units(self) -> dict[str, int]:
        units = dict(self.own_tp_shared_units())
        for part in self.parts().values():
            units |= part.tp_shared_units()
        return units

    def build(self, config, run: Execution) -> nn.Layer:
        return self.layer(config, run, self)


class Block(nn.Layer):
    """A layer whose children are its declaration's parts."""

    def __init__(self, config, run: Execution, declared: Declared):
        super().__init__()
        self.config, self.run, self.declared = config, run, declared
        for name, part in declared.built_parts(run).items():
            built = part.build(config, run)
            if isinstance(built, nn.Layer):
                self.add_sublayer(name, built)
            elif isinstance(part, Buffer):  # one persistent buffer of its block (Gemma 4's layer_scalar)
                self.register_buffer(name, built)
            else:  # a part that is one parameter of its block (per-head sinks)
                self.add_parameter(name, built)


@dataclass(frozen=True)
class ColumnLinear(Leaf):
    """Output features split over tp (and the bias with them); the output stays split. With `heads`
    (key/value projections) the features are that many heads, and more tp ranks than heads each hold
    the projection whole (`tp_layers.SharedColumnLinear`)."""

    in_features: int
    out_features: int
    bias: bool = False
    heads: int | None = None

    def tensors(self) -> dict[str, TensorPlan]:
        weight = {"weight": TensorPlan((self.in_features, self.out_features), Placement(COLUMN, tp_units=self.heads),
                                       linear=True, adaptable=True)}
        return weight | ({"bias": TensorPlan((self.out_features,), Placement(VECTOR_SPLIT, tp_units=self.heads),
                                             init=ZEROS)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        if self.heads is not None and run.tp > self.heads:
            return tp_gradients.mark(tp_layers.SharedColumnLinear(run, self.in_features, self.out_features, self.bias),
                                     run, always=True)
        return tp_layers.column_linear(run, self.in_features, self.out_features, self.bias)


@dataclass(frozen=True)
class RowLinear(Leaf):
    """Input features split over tp; partial outputs summed. The bias is added once, whole on every
    rank; under sequence parallelism each rank adds it to its positions only."""

    in_features: int
    out_features: int
    bias: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        weight = {"weight": TensorPlan((self.in_features, self.out_features), Placement(ROW), linear=True,
                                       adaptable=True)}
        return weight | ({"bias": TensorPlan((self.out_features,), Placement(REPLICATED), init=ZEROS,
                                             tp_partial_grad=UNDER_SEQUENCE_PARALLEL)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_layers.row_linear(run, self.in_features, self.out_features, self.bias)


@dataclass(frozen=True)
class Buffer(Leaf):
    """A persistent buffer of its block under the part's own name (saved and loaded, never trained),
    `shape` filled with `value`, equal on every rank (Gemma 4's per-layer `layer_scalar`)."""

    shape: tuple[int, ...]
    value: float

    def tensors(self) -> dict[str, TensorPlan]:
        return {"": TensorPlan(self.shape, Placement(REPLICATED), init=self.value, buffer=True)}

    def build(self, config, run: Execution):
        return paddle.full(list(self.shape), self.value, "float32")


@dataclass(frozen=True)
class VocabEmbedding(Leaf):
    """Token embedding [vocab, dim], vocabulary rows split over tp; `unit` the config field its
    vocabulary is (named when tp does not divide it)."""

    num_embeddings: int
    dim: int
    unit: str = "vocab_size"

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.num_embeddings, self.dim), Placement(VOCAB_ROWS))}

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_layers.vocab_embedding(run, self.num_embeddings, self.dim)

    def tp_units(self) -> dict[str, int]:
        return {self.unit: self.num_embeddings}


@dataclass(frozen=True)
class Embedding(Leaf):
    """An embedding every tp rank holds whole (learned positions)."""

    num_embeddings: int
    dim: int

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.num_embeddings, self.dim), Placement(REPLICATED))}

    def build(self, config, run: Execution) -> nn.Layer:
        return nn.Embedding(self.num_embeddings, self.dim)


@dataclass(frozen=True)
class Norm(Leaf):
    """RMSNorm (LayerNorm with `layer_norm`, without its bias when not `bias`) over `dim`, whole on
    every tp rank. Over the hidden size each rank sees every position unless sequence parallelism cuts
    them (its gradient is then summed over tp); over a head (`per_head`, q/k norms) each rank sees only
    its heads, so always. Over a whole projection that tp splits by heads (`split`, OLMoE's and
    OLMo-2's q/k norms) the weight is split with the projection's columns, each rank's block complete,
    and the mean square is summed over tp; with `group_size` (Mamba-2's gated norm) each group of that
    many entries is normalised alone, tp splitting whole groups."""

    dim: int
    eps: float
    offset: bool = False  # Gemma: scale by 1 + weight (weight starts at zero)
    layer_norm: bool = False
    per_head: bool = False
    split: bool = False
    bias: bool = True  # a LayerNorm's (MPT's have none)
    group_size: int | None = None
    computed_whole: bool = False  # as `WholeLinear.computed_whole`

    def tensors(self) -> dict[str, TensorPlan]:
        if self.split or self.group_size is not None:
            return {"weight": TensorPlan((self.dim,), Placement(VECTOR_SPLIT), init=ONES)}
        partial = None if self.computed_whole else ALWAYS if self.per_head else UNDER_SEQUENCE_PARALLEL
        scale = TensorPlan((self.dim,), Placement(REPLICATED), init=ZEROS if self.offset else ONES, tp_partial_grad=partial)
        bias = TensorPlan((self.dim,), Placement(REPLICATED), init=ZEROS, tp_partial_grad=partial)
        return {"weight": scale, "bias": bias} if self.layer_norm and self.bias else {"weight": scale}

    def build(self, config, run: Execution) -> nn.Layer:
        if self.group_size is not None:
            return GroupRMSNorm(self.dim // run.tp, self.eps, self.group_size, distributed=run.tp > 1)
        if self.split and run.tp > 1:
            return SplitRMSNorm(self.dim, self.eps, run.tp_group)
        if self.layer_norm:
            norm = nn.LayerNorm(self.dim, epsilon=self.eps, bias_attr=None if self.bias else False)
        else:
            norm = RMSNorm(self.dim, self.eps, self.offset, fused=run.kernels.fused_rms_norm)
        return norm if self.computed_whole else tp_gradients.mark(norm, run, always=self.per_head)


@dataclass(frozen=True)
class WholeLinear(Leaf):
    """A linear every tp rank holds whole (latent attention's down-projections, multi-token
    prediction's `eh_proj`). Under sequence parallelism each rank's gradient of it is a part (its
    positions', or its heads' where the block gathered the sequence first), summed over tp at the
    update; without, every rank computes the whole one. `computed_whole`: every rank computes it on the
    whole sequence under SP too, its input and what it is trained towards the same on each (the
    sparse-attention indexer's), so its gradient is whole on every rank and never summed."""

    in_features: int
    out_features: int
    bias: bool = False
    computed_whole: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        partial = None if self.computed_whole else UNDER_SEQUENCE_PARALLEL
        weight = TensorPlan((self.in_features, self.out_features), Placement(REPLICATED), linear=True,
                            tp_partial_grad=partial, adaptable=not self.computed_whole)
        return {"weight": weight} | ({"bias": TensorPlan((self.out_features,), Placement(REPLICATED), init=ZEROS,
                                                         tp_partial_grad=partial)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        linear = tp_layers.whole_linear(run, self.in_features, self.out_features, self.bias)
        return linear if self.computed_whole else tp_gradients.mark(linear, run)
