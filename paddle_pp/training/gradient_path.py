"""Every gradient's path from backward to the update, in the order a step takes it, with the Paddle
internals replaced on the way (each listed with its upstream call in docs/paddle-internals.md).

1. Backward. Under stage2/3 with context parallelism each gradient is multiplied by cp as backward
   produces it (`before_wrapping`: hooks on the parameters before the group-sharded wrapper takes
   them): that wrapper averages over fleet's dp x cp group, where each cp rank holds only its part.
2. Reduction over the data ranks (`_sync_gradients`, replacing `HybridParallelOptimizer.
   _hybrid_sync_grad`; stage1 or no sharding):
   a. the gradients each tp rank computes only a part of (SP's norms, per-head q/k norms:
      `modeling.tp_gradients`) summed over tp, in one fused all-reduce;
   b. the dense gradients over the sharding then the dp group, as upstream;
   c. the experts' gradients over the sharding group when its ranks hold the same experts (ep
      divides dp), then over their replicas only (`ExpertGroup.reduce_gradients`): upstream would
      mix different experts. Across sharding ranks stage1 leaves the experts alone
      (`runtime.expert_sharding`), so the replicas' sum is all they get.
   Stage2/3 reduce inside Paddle's group-sharded wrapper; neither (a) nor (c) arises there (refused).
3. Clipping (`_clip_reporting`): the global norm counts every expert of the expert group once
   (fleet's `HybridParallelClipGrad._comm_and_clip`, or the clip's own sum; with experts across
   sharding ranks, each held by its updating replica only, summed over the replicas too and added
   on sharding rank 0 only, as the hybrid clip sums over that group), stage3 clips with
   `grad_norm.ShardedParamsClip` instead of Paddle's `GroupShardedClipGrad`, and the norm the clip
   used is kept for the report (`HybridParallelClipGrad._global_norm`).
4. Recording (`--save_gradients`, `Optimizer._apply_optimize`): a copy of what the update applies.
5. The update (with experts across sharding ranks, stage1's updates each expert on one of its
   replicas and broadcasts it over them: `runtime.expert_sharding`); after it, stage2/3 with tp
   broadcast the replicated tensors (`replicated_sync`).
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)

from modeling.tp_gradients import is_partial, sum_partial_gradients
from paddle_pp.runtime.expert_sharding import shard_experts_over_replicas
from paddle_pp.runtime.experts import is_expert
from paddle_pp.runtime.fleet_wrappers import inner_optimizer, optimizer_chain
from paddle_pp.runtime.topology import Topology
from paddle_pp.training.grad_norm import ReportingGlobalNormClip, ShardedParamsClip, squares_with_every_expert

GRADIENT = "grad"


def before_wrapping(model: paddle.nn.Layer, topo: Topology) -> None:
    """Step 1, before `fleet_wrappers.wrap_for_layout` takes the model."""
    cp = topo.layout.cp
    if cp > 1 and topo.layout.group_sharded_level is not None:  # exact when cp is a power of two
        for param in model.parameters():
            if not param.stop_gradient:
                param.register_hook(lambda grad: grad * cp)


def after_wrapping(optimizer: Any, model: paddle.nn.Layer, topo: Topology, clip: ReportingGlobalNormClip | None,
                   record: bool = False) -> None:
    """Steps 2 to 5 on the wrapped `optimizer` (`clip` None: a clip of Paddle's own, left as it is)."""
    if topo.layout.experts_across_sharding:  # step 5: stage1 partitions the experts over their replicas
        shard_experts_over_replicas(optimizer, topo.experts)
    _sync_gradients(optimizer, model, topo)
    if clip is not None:
        _clip_reporting(optimizer, clip, model, topo)
    if record:
        _record_gradients(optimizer)


def _sync_gradients(optimizer: Any, model: paddle.nn.Layer, topo: Topology) -> None:
    partial = any(is_partial(p) for p in model.parameters())  # only with tp > 1
    if topo.layout.group_sharded_level is not None or not (partial or topo.experts is not None):
        return
    upstream = optimizer._hybrid_sync_grad

    def sync(parameter_list: list) -> None:
        if partial:
            sum_partial_gradients(parameter_list, topo.tp_group)
        if topo.experts is None:
            upstream(parameter_list)
            return
        experts = [p for p in parameter_list if is_expert(p)]
        upstream([p for p in parameter_list if not is_expert(p)])
        if optimizer._sharding_enable and not topo.layout.experts_across_sharding:
            optimizer._inner_opt.reduce_gradients(experts, topo.hcg)
            experts = optimizer._inner_opt.filter_parameters(experts, topo.hcg)
        topo.experts.reduce_gradients(experts)

    optimizer._hybrid_sync_grad = sync


def _clip_reporting(optimizer: Any, clip: ReportingGlobalNormClip, model: paddle.nn.Layer, topo: Topology) -> None:
    """The norm the optimizer clips with lands in `clip.last_norm` whatever the layout. On one process
    or pure data parallelism the optimizer keeps `clip`, which measures it; fleet swaps in its hybrid
    clip under TP, PP or sharding (stage2 too), read where it all-reduces; stage3 gets ours."""
    hybrid = next((o._grad_clip for o in optimizer_chain(optimizer)
                   if isinstance(getattr(o, "_grad_clip", None), HybridParallelClipGrad)), None)
    if topo.experts is not None:
        groups = [topo.experts.group]
        if hybrid is None:
            clip._squared_norm = lambda clipped: squares_with_every_expert(clipped, groups).sum()
        else:
            upstream = hybrid._comm_and_clip
            # experts across sharding ranks: each updated by one replica (`expert_sharding`), and counted
            # on sharding rank 0 only, as the hybrid clip sums over the sharding group
            across = topo.layout.experts_across_sharding
            if across and topo.experts.replicas is not None:
                groups.append(topo.experts.replicas)
            once = not across or topo.sharding_rank == 0

            def with_every_expert(params_grads, _dist_squares, _not_dist_squares):
                squares = squares_with_every_expert(params_grads, groups, once)
                return upstream(params_grads, squares[0], squares[1])

            hybrid._comm_and_clip = with_every_expert
    if topo.layout.group_sharded_level == "p_g_os":
        distributed = {p.name for p in model.parameters() if getattr(p, "is_distributed", False)}
        inner_optimizer(optimizer)._grad_clip = ShardedParamsClip(clip, topo, distributed)
    elif hybrid is not None:
        reduce_norm = hybrid._global_norm

        def recording_global_norm(dist_squares, not_dist_squares):
            reduce_norm(dist_squares, not_dist_squares)
            clip.last_norm = paddle.sqrt(dist_squares + not_dist_squares)

        hybrid._global_norm = recording_global_norm


def _record_gradients(optimizer: Any) -> None:
    """Every update leaves behind a copy of the gradients it applies: after the reductions and the TP
    sync, before clipping (one parameter-sized buffer per rank)."""
    inner = inner_optimizer(optimizer)
    apply = inner._apply_optimize

    def recording(loss, startup_program, params_grads):
        inner._recorded_gradients = {p.name: g.detach().clone() for p, g in params_grads if g is not None}
        return apply(loss, startup_program, params_grads)

    inner._apply_optimize = recording
    inner._recorded_gradients = {}


def recorded_gradients(optimizer: Any) -> dict[str, dict[str, paddle.Tensor]]:
    """{parameter's internal name: {"grad": tensor}} of the last update (shaped like
    `checkpoint.optimizer_state.states_by_parameter`, so the checkpoint saves it as a kind)."""
    return {name: {GRADIENT: grad} for name, grad in inner_optimizer(optimizer)._recorded_gradients.items()}
