"""Fleet's model and optimizer wrappers for a layout (minus one upstream gap), and the way back in.

Stage1 is fleet's sharding optimizer; stage2 and stage3 are Paddle's `group_sharded_parallel` over
the hybrid sharding group (with the dp group beside it), as PaddleNLP's Trainer applies them.
Paddle 3.3.1's `fleet.distributed_model` wraps any `PipelineLayer` on pp=1 in `NoPipelineParallel`,
which never synchronises gradients, while `HybridParallelOptimizer` in pure data-parallel mode
assumes `paddle.DataParallel` already did: data replicas then silently train apart (on GPU too).
For that one case the model goes through `paddle.DataParallel` on the dp group instead.
"""

from __future__ import annotations

from typing import Any, Iterator

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


def wrap_for_layout(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer, topo: Topology,
                    stage3_segment_size: int = 2**20) -> tuple[paddle.nn.Layer, Any]:
    """The layout's model and optimizer wrappers. Under stage2/stage3 the TP wrapper (when tp > 1)
    goes inside Paddle's group-sharded one, which partitions gradients (and, for stage3, each
    parameter of more than `stage3_segment_size` elements) over the sharding group and averages
    over the dp group; fleet's optimizer is not used there, as it would shard the states again.
    What the gradients and the update need beyond these wrappers: `training.gradient_path`."""
    level = topo.layout.group_sharded_level
    if level is None:
        return wrap_model(model, topo), wrap_optimizer(optimizer)
    from paddle.distributed.sharding import group_sharded_parallel

    align_ranks(topo)  # the wrappers start by broadcasting every parameter
    inner = fleet.distributed_model(model) if topo.layout.tp > 1 else model
    dp_group = topo.dp_group if topo.layout.dp > 1 else None
    if topo.layout.cp > 1:  # the cp ranks then reduce with the dp ranks (gradient_path scales them first)
        dp_group = topo.hcg.get_dp_sep_parallel_group()
    wrapped, optimizer, _ = group_sharded_parallel(inner, optimizer, level, group=topo.sharding_group,
                                                   dp_group=dp_group, segment_size=stage3_segment_size)
    return wrapped, optimizer


def optimizer_chain(optimizer: Any) -> Iterator[Any]:
    """`optimizer`, then each optimizer it wraps, outermost first: fleet's hybrid and sharding
    wrappers (`_inner_opt`), group-sharded stage2's (`_optim`; itself an Optimizer subclass holding
    no states). Stage3 marks the optimizer it redefines with `_optim` = itself: the chain ends there."""
    inner = optimizer
    yield inner
    while (wrapped := getattr(inner, "_inner_opt", None) or getattr(inner, "_optim", None)) not in (None, inner):
        inner = wrapped
        yield inner


def inner_optimizer(optimizer: Any) -> paddle.optimizer.Optimizer:
    """The Paddle optimizer inside every wrapper (`optimizer_chain`): the one holding states."""
    *_, inner = optimizer_chain(optimizer)
    if not isinstance(inner, paddle.optimizer.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} wraps no paddle.optimizer.Optimizer")
    return inner
