"""Stage1 with experts across sharding ranks: each rank updates its own experts, outside the partition.

Paddle 3.3.1's stage1 optimizer (`DygraphShardingOptimizer`) assumes every sharding rank holds the same
parameters: it gives each parameter (by name) to one sharding rank, reduces its gradient there, lets
that rank update it and broadcasts the result. When an expert group runs across sharding ranks
(`Layout.experts_across_sharding`), a rank's experts exist on no other rank of its sharding group, so
that cycle would send one rank's experts over another's. Here the partition is made again over the
dense parameters only (Paddle's own `_partition_parameters`, so the dense share is what it would be
without experts), every rank updates its share of the dense parameters and all of its own experts,
and only the dense ones are broadcast. The experts' AdamW states stay whole on each rank holding the
expert (replicated over its replicas, dp x sharding / ep ranks), as they are when ep divides dp and
no sharding is used; what stage1 saves on them there, ep already divides. Their gradients reach
them through `ExpertGroup.reduce_gradients` (`training.gradient_path`, step 2c).

Replaced (docs/paddle-internals.md): `DygraphShardingOptimizer._rank2params` / `_param2rank` (made
over the dense parameters) and `DygraphShardingOptimizer.step` (the same update and broadcast, with
this rank's experts added to its share).
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
    DygraphShardingOptimizer,
)

from paddle_pp.runtime.experts import is_expert


def update_experts_where_they_are(optimizer: Any) -> None:
    """On fleet's hybrid optimizer wrapping stage1's: see the module's doc."""
    sharding = optimizer._inner_opt
    if type(sharding) is not DygraphShardingOptimizer:
        raise TypeError(f"experts across sharding ranks need stage1's DygraphShardingOptimizer, not "
                        f"{type(sharding).__name__}")
    every = sharding._parameter_list
    experts = [p for p in every if is_expert(p)]
    sharding._parameter_list = [p for p in every if not is_expert(p)]
    sharding._rank2params = sharding._partition_parameters()
    sharding._parameter_list = every  # what the gradient sync and clear_grad go over
    sharding._param2rank = sharding._map_param_to_rank()
    updated = sharding._rank2params[sharding._sharding_rank] + experts
    sharding._set_inner_opt_attr("_parameter_list", updated)
    sharding._set_inner_opt_attr("_param_groups", updated)

    @paddle.no_grad()
    def step() -> None:
        mine = {id(p) for p in updated}
        params_grads = [(p, _gradient(p)) for p in sharding._origin_parameter_list
                        if id(p) in mine and not p.stop_gradient]
        sharding._apply_optimize(loss=None, startup_program=None, params_grads=params_grads)
        sharding._sharding_sync_parameters()  # over `_rank2params`: the dense parameters

    sharding.step = step


def _gradient(param) -> paddle.Tensor | None:
    main = getattr(param, "main_grad", None)
    return main if main is not None else param._grad_ivar()
