"""Global-norm clipping that also reports the norm it measured, under any layout.

On one process or pure data parallelism the optimizer keeps this clip and measures the norm
itself. Under TP, PP or sharding, fleet swaps in `HybridParallelClipGrad`, which all-reduces the
squared partial norms across the hybrid groups; `observe_hybrid_norm` reads the result there, so
the reported norm is exactly the one the clip used. Stage2 keeps fleet's hybrid clip too (Paddle's
stage2 optimizer installs it); stage3 gets `ShardedParamsClip` (see there).
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle import _C_ops

from paddle_pp.runtime.experts import is_expert
from paddle_pp.runtime.stage3 import SLICE_PREFIX


class ReportingGlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    def __init__(self, clip_norm: float):
        super().__init__(clip_norm)
        self.last_norm: paddle.Tensor | None = None

    def _dygraph_clip(self, params_grads):
        """Paddle's global-norm clip computed once and kept: the squared norms are summed in fp32 (as
        fleet's hybrid clip does), and each clipped gradient is scaled by
        clip_norm / max(norm, clip_norm). Measuring the norm separately before calling Paddle's clip
        cost a second pass over every gradient (6% of a small model's step on CPU)."""
        clipped = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)]
        if not clipped:
            self.last_norm = paddle.zeros([])
            return params_grads
        norm = paddle.sqrt(self._squared_norm(clipped))
        self.last_norm = norm
        scale = self.clip_norm / paddle.maximum(norm, paddle.full([], self.clip_norm, "float32"))
        return [(p, g if g is None or not getattr(p, "need_clip", True) else paddle.multiply(g, scale.astype(g.dtype)))
                for p, g in params_grads]

    def _squared_norm(self, clipped: list) -> paddle.Tensor:
        return _sum_of_squares([g for _, g in clipped])

    def pop_norm(self) -> float | None:
        norm, self.last_norm = self.last_norm, None
        return None if norm is None else float(norm)


def _sum_of_squares(grads: list) -> paddle.Tensor:
    if not grads:
        return paddle.zeros([], "float32")
    return paddle.stack([_C_ops.squared_l2_norm(g).astype("float32").reshape([]) for g in grads]).sum()


class ShardedParamsClip(ReportingGlobalNormClip):
    """Global-norm clipping under stage3, reporting into `reporting`.

    The optimizer sees each large parameter as this rank's flat slice ("slice@<name>": summed over
    the sharding group) and small ones whole ("unslice": identical on every sharding rank, counted
    once); a TP-split parameter's squares are also summed over the tp group. Paddle's
    `GroupShardedClipGrad` sums only over the sharding group (with TP it misses the other TP
    pieces, which is why PaddleNLP refuses TP with stage3) and moves the norm by `.cuda()`."""

    def __init__(self, reporting: ReportingGlobalNormClip, topo, distributed: set[str]):
        super().__init__(reporting.clip_norm)
        self.reporting, self.topo, self.distributed = reporting, topo, distributed

    def _squared_norm(self, clipped: list) -> paddle.Tensor:
        parts: dict[tuple[bool, bool], list] = {(s, d): [] for s in (True, False) for d in (True, False)}
        for p, g in clipped:
            parts[(not hasattr(p, "unslice"), p.name.removeprefix(SLICE_PREFIX) in self.distributed)].append(g)
        by_tp = paddle.stack([_sum_of_squares(parts[(True, True)]), _sum_of_squares(parts[(False, True)])])
        if self.topo.layout.tp > 1:
            dist.all_reduce(by_tp, group=self.topo.tp_group)
        sliced = by_tp[0] + _sum_of_squares(parts[(True, False)])
        dist.all_reduce(sliced, group=self.topo.sharding_group)
        return sliced + by_tp[1] + _sum_of_squares(parts[(False, False)])

    def _dygraph_clip(self, params_grads):
        clipped = super()._dygraph_clip(params_grads)
        self.reporting.last_norm = self.last_norm
        return clipped


def report_clipped_norm(optimizer, clip: ReportingGlobalNormClip, model, topo) -> None:
    """After wrapping: the norm the optimizer clips with lands in `clip.last_norm` whatever the layout."""
    from paddle_pp.runtime.fleet_wrappers import inner_optimizer

    if topo.experts is not None:
        count_experts_once(optimizer, clip, topo.experts.group)
    if topo.layout.group_sharded_level == "p_g_os":
        distributed = {p.name for p in model.parameters() if getattr(p, "is_distributed", False)}
        inner_optimizer(optimizer)._grad_clip = ShardedParamsClip(clip, topo, distributed)
    else:
        observe_hybrid_norm(optimizer, clip)


def _squares_by_split(params_grads, experts: bool) -> paddle.Tensor:
    """[tp-split, whole] squared norms of the clipped gradients of expert (or of other) parameters,
    counting a weight tied across pipeline stages once (fleet's `is_firstly_shared` rule)."""
    counted = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)
               and getattr(p, "is_firstly_shared", True) and is_expert(p) == experts]
    return paddle.stack([_sum_of_squares([g for p, g in counted if p.is_distributed == split]) for split in (True, False)])


def _squares_with_every_expert(params_grads, group) -> paddle.Tensor:
    """[tp-split, whole] squared norms of this rank's dense gradients plus every expert of its expert
    group (summed over the group). Recomputed from the gradients rather than adding the other ranks'
    experts to a sum that holds this rank's: the result must be bit-identical on the data replicas,
    whose own experts differ, or their clipped updates drift apart."""
    experts = _squares_by_split(params_grads, experts=True)
    dist.all_reduce(experts, group=group)
    return _squares_by_split(params_grads, experts=False) + experts


def count_experts_once(optimizer, clip: ReportingGlobalNormClip, group) -> None:
    """Under expert parallelism the global norm must also count the experts held by the other ranks
    of the expert group, which no upstream clip reduces over (fleet's sums over tp, pp and sharding
    only; one process's over nothing): fleet's `_comm_and_clip` (replaced here) or this clip's own
    sum get the squares of `_squares_with_every_expert` before their own reductions."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )

    from paddle_pp.runtime.fleet_wrappers import optimizer_chain

    hybrid = next((o._grad_clip for o in optimizer_chain(optimizer)
                   if isinstance(getattr(o, "_grad_clip", None), HybridParallelClipGrad)), None)
    if hybrid is None:
        clip._squared_norm = lambda clipped: _squares_with_every_expert(clipped, group).sum()
        return
    upstream = hybrid._comm_and_clip

    def with_every_expert(params_grads, _dist_squares, _not_dist_squares):
        squares = _squares_with_every_expert(params_grads, group)
        return upstream(params_grads, squares[0], squares[1])

    hybrid._comm_and_clip = with_every_expert


def observe_hybrid_norm(optimizer, clip: ReportingGlobalNormClip) -> None:
    """Record the all-reduced norm into `clip` when fleet replaced it by its hybrid clip."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )

    from paddle_pp.runtime.fleet_wrappers import optimizer_chain

    inner = next((o for o in optimizer_chain(optimizer) if isinstance(getattr(o, "_grad_clip", None),
                                                                      HybridParallelClipGrad)), None)
    if inner is None:
        return
    hybrid = inner._grad_clip
    reduce_norm = hybrid._global_norm

    def recording_global_norm(dist_squares, not_dist_squares):
        reduce_norm(dist_squares, not_dist_squares)
        clip.last_norm = paddle.sqrt(dist_squares + not_dist_squares)

    hybrid._global_norm = recording_global_norm
