"""Fleet's model and optimizer wrappers for a layout (minus one upstream gap), and the way back in.

Paddle 3.3.1's `fleet.distributed_model` wraps any `PipelineLayer` on pp=1 in `NoPipelineParallel`,
which never synchronises gradients, while `HybridParallelOptimizer` in pure data-parallel mode
assumes `paddle.DataParallel` already did: data replicas then silently train apart (on GPU too).
For that one case the model goes through `paddle.DataParallel` on the dp group instead.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.base.topology import ParallelMode
from paddle.distributed.fleet.meta_parallel import PipelineLayer

from paddle_pp.runtime.topology import Topology, align_ranks


def wrap_model(model: paddle.nn.Layer, topo: Topology) -> paddle.nn.Layer:
    """The layout's model wrapper (pipeline schedule, TP input broadcast, DP gradient sync)."""
    if topo.layout.world_size == 1:
        return model  # fleet would wrap a plain Layer in NoPipelineParallel, which requires a PipelineLayer
    align_ranks(topo)  # building stages takes unequal time; the wrappers start with broadcasts
    if (
        isinstance(model, PipelineLayer)
        and topo.layout.pp == 1
        and topo.hcg.get_parallel_mode() == ParallelMode.DATA_PARALLEL
    ):
        return paddle.DataParallel(model, group=topo.dp_group)
    return fleet.distributed_model(model)


def wrap_optimizer(optimizer: paddle.optimizer.Optimizer) -> Any:
    """Fleet's hybrid optimizer: sharding stage1 partitioning and global-norm clipping across all groups."""
    return fleet.distributed_optimizer(optimizer)


def inner_optimizer(optimizer: Any) -> paddle.optimizer.Optimizer:
    """The Paddle optimizer inside fleet's hybrid and sharding wrappers (the one holding states)."""
    inner = optimizer
    while not isinstance(inner, paddle.optimizer.Optimizer):
        inner = getattr(inner, "_inner_opt", None)
        if inner is None:
            raise TypeError(f"{type(optimizer).__name__} wraps no paddle.optimizer.Optimizer")
    return inner
