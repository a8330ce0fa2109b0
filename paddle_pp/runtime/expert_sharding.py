"""Stage1 with experts across sharding ranks: each expert updated by one of the ranks holding it.

Paddle 3.3.1's stage1 optimizer (`DygraphShardingOptimizer`) assumes every sharding rank holds the same
parameters: it gives each parameter (by name) to one sharding rank, reduces its gradient there, lets
that rank update it and broadcasts the result. When an expert group runs across sharding ranks
(`Layout.experts_across_sharding`), a rank's experts exist on no other rank of its sharding group, so
that cycle would send one rank's experts over another's. Here the partition is made again over the
dense parameters only (Paddle's own `_partition_parameters`, so the dense share is what it would be
without experts), and the experts are partitioned the same way (`partitions.sharding_owners`) over
their own replicas, the ranks holding the same experts (dp x sharding x cp / ep of them: ZeRO-1 over
the expert-data group, as Megatron and DeepSpeed shard expert states). Every rank updates its share
of the dense parameters and of its experts; the dense ones are broadcast over the sharding group as
upstream, the experts over their replicas. Their gradients reach them through
`ExpertGroup.reduce_gradients` (`training.gradient_path`, step 2c), summed over the same replicas.

Replaced (docs/paddle-internals.md): `DygraphShardingOptimizer._rank2params` / `_param2rank` (made
over the dense parameters) and `DygraphShardingOptimizer.step` (the same update and dense broadcast,
with this rank's share of its experts added, then their broadcast over the replicas).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
    DygraphShardingOptimizer,
)

from paddle_pp.runtime.experts import ExpertGroup, is_expert
from paddle_pp.runtime.partitions import sharding_owners


def shard_experts_over_replicas(optimizer: Any, experts: ExpertGroup) -> None:
    """On fleet's hybrid optimizer wrapping stage1's: see the module's doc."""
    sharding = optimizer._inner_opt
    if type(sharding) is not DygraphShardingOptimizer:
        raise TypeError(f"experts across sharding ranks need stage1's DygraphShardingOptimizer, not "
                        f"{type(sharding).__name__}")
    every = sharding._parameter_list
    held = [p for p in every if is_expert(p) and not p.stop_gradient]
    sharding._parameter_list = [p for p in every if not is_expert(p)]
    sharding._rank2params = sharding._partition_parameters()
    sharding._parameter_list = every  # what the gradient sync and clear_grad go over
    sharding._param2rank = sharding._map_param_to_rank()
    replicas = experts.replicas
    owners = sharding_owners([int(np.prod(p.shape)) for p in held], replicas.nranks if replicas else 1)
    mine = replicas.rank if replicas else 0
    updated = sharding._rank2params[sharding._sharding_rank] + [p for p, o in zip(held, owners) if o == mine]
    sharding._set_inner_opt_attr("_parameter_list", updated)
    sharding._set_inner_opt_attr("_param_groups", updated)

    @paddle.no_grad()
    def step() -> None:
        ids = {id(p) for p in updated}
        params_grads = [(p, _gradient(p)) for p in sharding._origin_parameter_list
                        if id(p) in ids and not p.stop_gradient]
        sharding._apply_optimize(loss=None, startup_program=None, params_grads=params_grads)
        sharding._sharding_sync_parameters()  # over `_rank2params`: the dense parameters
        if replicas is not None:  # every replica holds `held` in one order
            tasks = [dist.broadcast(p, src=replicas.ranks[o], group=replicas, sync_op=False)
                     for p, o in zip(held, owners)]
            for task in tasks:
                task.wait()

    sharding.step = step


def _gradient(param) -> paddle.Tensor | None:
    main = getattr(param, "main_grad", None)
    return main if main is not None else param._grad_ivar()
