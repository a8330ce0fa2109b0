"""Sequence parallelism (Korthikanti et al., 2022; PaddleNLP's `--sequence_parallel`) around the
tensor-parallel layers, with Paddle's `fleet.utils.sequence_parallel_utils` doing the communication.

Under TP every rank holds the whole [batch, seq, hidden] activation around the norms and residual
adds. With SP those regions hold [seq / tp, batch, hidden] instead (sequence first, so a rank's
slice is a run of positions): the embedding's output is scattered along the sequence, each
attention and MLP block all-gathers its normed input once (`gather_tokens`: its backward is a
reduce-scatter) and its row-parallel output linear reduce-scatters (in place of TP's all-reduce),
and the head gathers the sequence back. Norm weights (and row-linear biases) then see only their
rank's positions, so their gradients are summed over tp (`modeling.tp_gradients`).

Parameters keep their names and shapes, so checkpoints do not depend on SP.
"""

from __future__ import annotations

import paddle
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from modeling.execution import Execution


def sequence_shards(tp: int, sequence_parallel: bool) -> int:
    """Over how many ranks the activations around the norms and residual adds are split: the
    sequence is cut over tp under SP, and whole on every tp rank without it (for memory models)."""
    return tp if sequence_parallel else 1


def scatter_sequence(hidden: paddle.Tensor, run: Execution) -> paddle.Tensor:
    """[batch, seq, hidden] -> this rank's [seq / tp, batch, hidden] (identity without SP)."""
    if not run.sequence_first:
        return hidden
    return sp_utils.ScatterOp.apply(hidden.transpose([1, 0, 2]))


def gather_sequence(hidden: paddle.Tensor, run: Execution) -> paddle.Tensor:
    """This rank's [seq / tp, batch, hidden] -> [batch, seq, hidden] for the head (identity without SP).
    The backward keeps this rank's rows of a gradient the vocabulary-parallel head already summed."""
    if not run.sequence_first:
        return hidden
    return sp_utils.GatherOp.apply(hidden).transpose([1, 0, 2])


def gather_tokens(hidden: paddle.Tensor, run: Execution) -> paddle.Tensor:
    """The whole sequence [seq, batch, hidden] as input of a block's column-parallel linears, gathered
    once per block (Paddle's ColumnSequenceParallelLinear gathers once per linear: three times for
    q, k, v). Its backward reduce-scatters the summed input gradient."""
    if not run.sequence_first:
        return hidden
    # contiguous first: a block without a norm before it (OLMo-2) gets the residual stream, which the
    # embedding's scatter may leave as a strided view, and the gather refuses one
    return sp_utils.AllGatherOp.apply(hidden.contiguous())
