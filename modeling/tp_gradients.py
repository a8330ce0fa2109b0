"""Parameters every tp rank holds whole but whose gradient each rank computes only a part of, and
the one all-reduce over tp that completes those gradients each step (run first in the hybrid
optimizer's gradient sync: `training.gradient_path`, step 2a).

Two cases: under sequence parallelism a norm weight (or a row-linear bias) sees only this rank's
positions; a per-head norm (Qwen3's q/k norms) always sees only this rank's heads. Without the sum
the copies drift apart, and the replica check aborts the next save.
"""

from __future__ import annotations

from typing import Any

from paddle import nn
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


def is_partial(param) -> bool:
    return getattr(param, PARTIAL_OVER_HEADS, False) or sp_utils.is_sequence_parallel_parameter(param)


def sum_partial_gradients(parameters: list, tp_group: Any) -> None:
    """Sum the gradients of the marked parameters among `parameters` over tp, in one fused
    all-reduce.

    Paddle's `register_sequence_parallel_allreduce_hooks(..., fuse=True)` would sum them in backward
    hooks, but its hook takes a gradient argument while `_register_backward_hook` calls hooks with
    none (Paddle 3.3.1), and a hook that counts gradients to find the last one goes wrong the step a
    marked parameter gets none. Summing at the update has neither problem."""
    partial = [p for p in parameters if not p.stop_gradient and is_partial(p)]
    if partial:
        fused_allreduce_gradients_with_group(partial, group=tp_group, scale=1.0)
