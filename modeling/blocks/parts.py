"""What a block is made of, declared once: each part says its parameters' plans (shape, tp
placement, initial values, whether the gradient is partial per tp rank) and builds its layer; the
model adds the stage placement and the experts block the expert one (`tp_plan.Placement`).

A block (`Block`) declares its parts by name in `declare(config)`; its `__init__` builds each part as
the child of that name for the run's `Execution` (single card, or fleet's parallel layers under TP),
and `tensors(config)` collects the parts' placements under the same names. So a model's TP plan is
read off the declarations its layers are built from, never kept by hand, and does not depend on
how a run computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from paddle import nn

from modeling import tp_gradients, tp_layers
from modeling.blocks.norms import RMSNorm, SplitRMSNorm
from modeling.execution import Execution
from modeling.tp_plan import (
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


class Leaf(Protocol):
    def tensors(self) -> dict[str, TensorPlan]: ...

    def build(self, config, run: Execution) -> nn.Layer: ...


Part = Union[Leaf, type["Block"]]


class Block(nn.Layer):
    """A layer whose children are its declared parts (leaves or other blocks)."""

    @classmethod
    def declare(cls, config) -> dict[str, Part]:
        raise NotImplementedError

    @classmethod
    def tp_fields(cls, config) -> tuple[str, ...]:
        """Config fields whose units tensor parallelism splits (heads, MLP width): each must divide by tp."""
        return ()

    @classmethod
    def for_layer(cls, config, index: int) -> type["Block"]:
        """The class decoder layer `index` is built from (a layer whose parts depend on its place
        returns a subclass that knows it)."""
        return cls

    @classmethod
    def kind(cls) -> type["Block"]:
        """The class whose parts this one declares (itself, unless it only adds a place)."""
        return cls

    @classmethod
    def built_parts(cls, config, run: Execution) -> dict[str, Part]:
        """The declared parts this rank builds: all of them, unless the run holds only a share
        (experts under expert parallelism)."""
        return cls.declare(config)

    def __init__(self, config, run: Execution):
        super().__init__()
        self.config, self.run = config, run
        for name, part in self.built_parts(config, run).items():
            self.add_sublayer(name, part(config, run) if isinstance(part, type) else part.build(config, run))

    @classmethod
    def tensors(cls, config) -> dict[str, TensorPlan]:
        return {f"{name}.{key}": row for name, part in cls.declare(config).items()
                for key, row in (part.tensors(config) if isinstance(part, type) else part.tensors()).items()}

    @classmethod
    def all_tp_fields(cls, config) -> tuple[str, ...]:
        """`tp_fields` of this block and of every block it is made of."""
        nested = [part.all_tp_fields(config) for part in cls.declare(config).values() if isinstance(part, type)]
        return tuple(dict.fromkeys(cls.tp_fields(config) + sum(nested, ())))


@dataclass(frozen=True)
class ColumnLinear:
    """Output features split over tp (and the bias with them); the output stays split."""

    in_features: int
    out_features: int
    bias: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        weight = {"weight": TensorPlan((self.in_features, self.out_features), Placement(COLUMN), linear=True)}
        return weight | ({"bias": TensorPlan((self.out_features,), Placement(VECTOR_SPLIT), init=ZEROS)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_layers.column_linear(run, self.in_features, self.out_features, self.bias)


@dataclass(frozen=True)
class RowLinear:
    """Input features split over tp; partial outputs summed. The bias is added once, whole on every
    rank; under sequence parallelism each rank adds it to its positions only."""

    in_features: int
    out_features: int
    bias: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        weight = {"weight": TensorPlan((self.in_features, self.out_features), Placement(ROW), linear=True)}
        return weight | ({"bias": TensorPlan((self.out_features,), Placement(REPLICATED), init=ZEROS,
                                             tp_partial_grad=UNDER_SEQUENCE_PARALLEL)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_layers.row_linear(run, self.in_features, self.out_features, self.bias)


@dataclass(frozen=True)
class VocabEmbedding:
    """Token embedding [vocab, hidden], vocabulary rows split over tp."""

    num_embeddings: int
    dim: int

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.num_embeddings, self.dim), Placement(VOCAB_ROWS))}

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_layers.vocab_embedding(run, self.num_embeddings, self.dim)


@dataclass(frozen=True)
class Embedding:
    """An embedding every tp rank holds whole (learned positions)."""

    num_embeddings: int
    dim: int

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.num_embeddings, self.dim), Placement(REPLICATED))}

    def build(self, config, run: Execution) -> nn.Layer:
        return nn.Embedding(self.num_embeddings, self.dim)


@dataclass(frozen=True)
class Norm:
    """RMSNorm (LayerNorm with `layer_norm`) over `dim`, whole on every tp rank. Over the hidden size
    each rank sees every position unless sequence parallelism cuts them (its gradient is then summed
    over tp); over a head (`per_head`, q/k norms) each rank sees only its heads, so always. Over a
    whole projection that tp splits by heads (`split`, OLMoE's q/k norms) the weight is split with
    the projection's columns, each rank's block complete, and the mean square is summed over tp."""

    dim: int
    eps: float
    offset: bool = False  # Gemma: scale by 1 + weight (weight starts at zero)
    layer_norm: bool = False
    per_head: bool = False
    split: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        if self.split:
            return {"weight": TensorPlan((self.dim,), Placement(VECTOR_SPLIT), init=ONES)}
        partial = ALWAYS if self.per_head else UNDER_SEQUENCE_PARALLEL
        scale = TensorPlan((self.dim,), Placement(REPLICATED), init=ZEROS if self.offset else ONES, tp_partial_grad=partial)
        bias = TensorPlan((self.dim,), Placement(REPLICATED), init=ZEROS, tp_partial_grad=partial)
        return {"weight": scale, "bias": bias} if self.layer_norm else {"weight": scale}

    def build(self, config, run: Execution) -> nn.Layer:
        if self.split and run.tp > 1:
            return SplitRMSNorm(self.dim, self.eps, tp_layers.tp_group())
        norm = nn.LayerNorm(self.dim, epsilon=self.eps) if self.layer_norm else \
            RMSNorm(self.dim, self.eps, self.offset, fused=run.kernels.fused_rms_norm)
        return tp_gradients.mark(norm, run, always=self.per_head)
