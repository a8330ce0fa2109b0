"""Global-norm clipping that also reports the norm it measured, under any layout.

On one process or pure data parallelism the optimizer keeps this clip and measures the norm
itself. Under TP, PP or sharding, fleet swaps in `HybridParallelClipGrad`, which all-reduces the
squared partial norms across the hybrid groups; the reported norm is read there, so it is exactly
the one the clip used. Stage2 keeps fleet's hybrid clip too (Paddle's stage2 optimizer installs
it); stage3 gets `ShardedParamsClip` (see there). Where each is installed, and how expert
parallelism's norm counts every expert once: `training.gradient_path`, step 3.
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


def _squares_by_split(params_grads, experts: bool) -> paddle.Tensor:
    """[tp-split, whole] squared norms of the clipped gradients of expert (or of other) parameters,
    counting a weight tied across pipeline stages once (fleet's `is_firstly_shared` rule)."""
    counted = [(p, g) for p, g in params_grads if g is not None and getattr(p, "need_clip", True)
               and getattr(p, "is_firstly_shared", True) and is_expert(p) == experts]
    return paddle.stack([_sum_of_squares([g for p, g in counted if p.is_distributed == split]) for split in (True, False)])


def squares_with_every_expert(params_grads, groups: list, with_experts: bool = True) -> paddle.Tensor:
    """[tp-split, whole] squared norms of this rank's dense gradients plus every expert of its expert
    group (summed over each of `groups` in turn: the expert group, then the replicas when they
    share its experts' updates; left out when not `with_experts`: a rank whose sharding peers' sum
    already counts them). Recomputed from the gradients rather than adding the other ranks'
    experts to a sum that holds this rank's: the result must be bit-identical on the data replicas,
    whose own experts differ, or their clipped updates drift apart."""
    experts = _squares_by_split(params_grads, experts=True)
    for group in groups:
        dist.all_reduce(experts, group=group)
    dense = _squares_by_split(params_grads, experts=False)
    return dense + experts if with_experts else dense
