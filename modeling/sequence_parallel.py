"""Sequence parallelism (Korthikanti et al., 2022; PaddleNLP's `--sequence_parallel`) around the
tensor-parallel layers, with Paddle's `fleet.utils.sequence_parallel_utils` doing the communication.

Under TP every rank holds the whole [batch, seq, hidden] activation around the norms and residual
adds. With SP those regions hold [seq / tp, batch, hidden] instead (sequence first, so a rank's
slice is a run of positions): the embedding's output is scattered along the sequence, each
attention and MLP block all-gathers its normed input once (`gather_tokens`: its backward is a
reduce-scatter) and its row-parallel output linear reduce-scatters (in place of TP's all-reduce),
and the head gathers the sequence back. Norm weights (and row-linear biases) then see only their
rank's positions, so their gradients are summed over tp by Paddle's allreduce hooks.

Parameters keep their names and shapes, so checkpoints do not depend on SP.
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group


def enabled(config) -> bool:
    return bool(getattr(config, "sequence_parallel", False)) and max(config.tensor_parallel_degree, 1) > 1


def sequence_shards(tp: int, sequence_parallel: bool) -> int:
    """Over how many ranks the activations around the norms and residual adds are split: the
    sequence is cut over tp under SP, and whole on every tp rank without it (for memory models)."""
    return tp if sequence_parallel else 1


def scatter_sequence(hidden: paddle.Tensor, config) -> paddle.Tensor:
    """[batch, seq, hidden] -> this rank's [seq / tp, batch, hidden] (identity without SP)."""
    if not enabled(config):
        return hidden
    return sp_utils.ScatterOp.apply(hidden.transpose([1, 0, 2]))


def gather_sequence(hidden: paddle.Tensor, config) -> paddle.Tensor:
    """This rank's [seq / tp, batch, hidden] -> [batch, seq, hidden] for the head (identity without SP).
    The backward keeps this rank's rows of a gradient the vocabulary-parallel head already summed."""
    if not enabled(config):
        return hidden
    return sp_utils.GatherOp.apply(hidden).transpose([1, 0, 2])


def gather_tokens(hidden: paddle.Tensor, config) -> paddle.Tensor:
    """The whole sequence [seq, batch, hidden] as input of a block's column-parallel linears, gathered
    once per block (Paddle's ColumnSequenceParallelLinear gathers once per linear: three times for
    q, k, v). Its backward reduce-scatters the summed input gradient."""
    if not enabled(config):
        return hidden
    return sp_utils.AllGatherOp.apply(hidden)


def mark_norm(norm: nn.Layer, config) -> nn.Layer:
    """Mark a norm's parameters as sequence-parallel: they see only this rank's positions."""
    if enabled(config):
        for param in norm.parameters():
            sp_utils.mark_as_sequence_parallel_parameter(param)
    return norm


def register_gradient_allreduce(model: nn.Layer, config, accumulate_steps: int) -> None:
    """Sum the gradients of sequence-parallel parameters over tp once per optimizer step: after the
    last of `accumulate_steps` backward passes has produced the last of them, in one fused all-reduce.

    Paddle's `register_sequence_parallel_allreduce_hooks(..., fuse=True)` would do this, but its hook
    takes a gradient argument while `_register_backward_hook` calls hooks with none (Paddle 3.3.1):
    the TypeError it leaves pending surfaces as the next PyLayer's "Get backward function failed".
    Its unfused variant works but issues one all-reduce per norm weight."""
    if not enabled(config):
        return
    params = [p for p in model.parameters() if sp_utils.is_sequence_parallel_parameter(p) and not p.stop_gradient]
    group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    ready, expected = [0], accumulate_steps * len(params)

    def allreduce_once_all_are_ready() -> None:
        ready[0] += 1
        if ready[0] == expected:
            ready[0] = 0
            fused_allreduce_gradients_with_group(params, group=group, scale=1.0)

    for param in params:
        param._register_backward_hook(allreduce_once_all_are_ready)
