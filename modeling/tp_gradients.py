"""Parameters every tp rank holds whole but whose gradient each rank computes only a part of, and
the one all-reduce over tp that completes those gradients each step.

Two cases: under sequence parallelism a norm weight (or a row-linear bias) sees only this rank's
positions; a per-head norm (Qwen3's q/k norms) always sees only this rank's heads. Without the sum
the copies drift apart, and the replica check aborts the next save.
"""

from __future__ import annotations

from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group

from modeling.execution import Execution

PARTIAL_OVER_HEADS = "tp_partial_over_heads"  # attribute marking a parameter that sees only this rank's heads


def mark(layer: nn.Layer, run: Execution, always: bool = False) -> nn.Layer:
    """Mark `layer`'s parameters as seeing only a part of the input on each tp rank: its heads
    (`always`), or its positions under sequence parallelism (Paddle's own mark)."""
    if always and run.tp > 1:
        for param in layer.parameters():
            setattr(param, PARTIAL_OVER_HEADS, True)
    elif run.sequence_first:
        for param in layer.parameters():
            sp_utils.mark_as_sequence_parallel_parameter(param)
    return layer


def partial_parameters(model: nn.Layer) -> list:
    return [p for p in model.parameters() if not p.stop_gradient
            and (getattr(p, PARTIAL_OVER_HEADS, False) or sp_utils.is_sequence_parallel_parameter(p))]


def register_gradient_allreduce(model: nn.Layer, accumulate_steps: int) -> None:
    """Sum the gradients of marked parameters over tp once per optimizer step: after the last of
    `accumulate_steps` backward passes has produced the last of them, in one fused all-reduce.

    Paddle's `register_sequence_parallel_allreduce_hooks(..., fuse=True)` would do this under SP, but
    its hook takes a gradient argument while `_register_backward_hook` calls hooks with none (Paddle
    3.3.1): the TypeError it leaves pending surfaces as the next PyLayer's "Get backward function
    failed". Its unfused variant works but issues one all-reduce per norm weight."""
    params = partial_parameters(model)
    if not params:
        return
    group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    ready, expected = [0], accumulate_steps * len(params)

    def allreduce_once_all_are_ready() -> None:
        ready[0] += 1
        if ready[0] == expected:
            ready[0] = 0
            fused_allreduce_gradients_with_group(params, group=group, scale=1.0)

    for param in params:
        param._register_backward_hook(allreduce_once_all_are_ready)
