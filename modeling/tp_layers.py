"""Layers that become fleet's tensor-parallel layers when tp > 1 and plain Paddle layers otherwise.

Model files call these instead of choosing between the two, so a model reads like its single-card
form and the split follows from the run's `Execution` alone.
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.distributed.fleet.layers.mpu import mp_layers
from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import SplitBWLinear
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from modeling.execution import Execution


class GatheredColumnLinear(sp_utils.ColumnSequenceParallelLinear):
    """Paddle's sequence-parallel column linear (same parameters) on an input its block already
    gathered (`sequence_parallel.gather_tokens`), so q, k and v share one all-gather."""

    def forward(self, x):
        return self.linear(x, self.weight, self.bias, name=self._name)


def column_linear(run: Execution, in_features: int, out_features: int, bias: bool = False) -> nn.Layer:
    """Output features split over tp ranks; the output stays split for the matching row linear."""
    if run.sequence_first:
        return GatheredColumnLinear(in_features, out_features, has_bias=bias, gather_output=False)
    if run.tp > 1:
        return mp_layers.ColumnParallelLinear(in_features, out_features, has_bias=bias, gather_output=False)
    return whole_linear(run, in_features, out_features, bias)


class SharedColumnLinear(nn.Linear):
    """A column linear every tp rank holds whole (a key/value projection with fewer heads than tp
    ranks): each rank uses only its queries' heads of the output, so its gradients are partial, the
    weight's summed over tp at the update (`tp_gradients`), the input's over tp in backward (an
    identity whose backward all-reduces, as fleet's column linear has; under sequence parallelism the
    block's gather already reduce-scatters it)."""

    def __init__(self, run: Execution, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias_attr=None if bias else False)
        self.tp_group = None if run.sequence_first else run.tp_group

    def forward(self, x):
        if self.tp_group is not None:
            x = paddle.distributed.collective._c_identity(x, group=self.tp_group)
        return super().forward(x)


def row_linear(run: Execution, in_features: int, out_features: int, bias: bool = False) -> nn.Layer:
    """Input features split over tp ranks; partial outputs are all-reduced (bias added once), or under
    sequence parallelism reduce-scattered along the sequence (the bias then marked sequence-parallel)."""
    if run.sequence_first:
        return sp_utils.RowSequenceParallelLinear(in_features, out_features, has_bias=bias, input_is_parallel=True)
    if run.tp > 1:
        return mp_layers.RowParallelLinear(in_features, out_features, has_bias=bias, input_is_parallel=True)
    return whole_linear(run, in_features, out_features, bias)


def whole_linear(run: Execution, in_features: int, out_features: int, bias: bool = False) -> nn.Layer:
    """A linear held whole: Paddle's `nn.Linear`, or under DualPipeV its `SplitBWLinear` (the same
    parameters), whose backward leaves the weight gradient to the schedule's weight pass, which
    DualPipeV runs where a stage would otherwise wait (its zero-bubble split). Fleet's tensor-parallel
    linears have no such split: under tp they compute both gradients at once."""
    linear = SplitBWLinear if run.dualpipev else nn.Linear
    return linear(in_features, out_features, bias_attr=None if bias else False)


def vocab_embedding(run: Execution, num_embeddings: int, dim: int) -> nn.Layer:
    """Vocabulary rows split over tp ranks; lookups outside a rank's rows are zero, then all-reduced."""
    if run.tp > 1:
        return mp_layers.VocabParallelEmbedding(num_embeddings, dim)
    return nn.Embedding(num_embeddings, dim)


def vocab_logits(hidden: paddle.Tensor, weight: paddle.Tensor, run: Execution, transpose_y: bool) -> paddle.Tensor:
    """Logits over this rank's vocabulary slice. Under TP the input is an identity whose backward
    all-reduces over the run's tp group, since every rank's slice of the vocabulary contributes to the
    hidden-state gradient."""
    if run.tp > 1:
        hidden = paddle.distributed.collective._c_identity(hidden, group=run.tp_group)
    return paddle.matmul(hidden, weight, transpose_y=transpose_y)
