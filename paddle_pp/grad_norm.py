"""Global-norm clipping that also reports the norm it measured, under any layout.

On one process or pure data parallelism the optimizer keeps this clip and measures the norm
itself. Under TP, PP or sharding, fleet swaps in `HybridParallelClipGrad`, which all-reduces the
squared partial norms across the hybrid groups; `observe_hybrid_norm` reads the result there, so
the reported norm is exactly the one the clip used.
"""

from __future__ import annotations

import paddle


class ReportingGlobalNormClip(paddle.nn.ClipGradByGlobalNorm):
    def __init__(self, clip_norm: float):
        super().__init__(clip_norm)
        self.last_norm: paddle.Tensor | None = None

    def _dygraph_clip(self, params_grads):
        squares = [paddle.sum(g.astype("float32") ** 2) for p, g in params_grads
                   if g is not None and getattr(p, "need_clip", True)]
        self.last_norm = paddle.sqrt(paddle.add_n(squares)) if squares else paddle.zeros([])
        return super()._dygraph_clip(params_grads)

    def pop_norm(self) -> float | None:
        norm, self.last_norm = self.last_norm, None
        return None if norm is None else float(norm)


def observe_hybrid_norm(optimizer, clip: ReportingGlobalNormClip) -> None:
    """Record the all-reduced norm into `clip` when fleet replaced it by its hybrid clip."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelClipGrad,
    )

    inner = optimizer
    while inner is not None and not isinstance(getattr(inner, "_grad_clip", None), HybridParallelClipGrad):
        inner = getattr(inner, "_inner_opt", None)
    if inner is None:
        return
    hybrid = inner._grad_clip
    reduce_norm = hybrid._global_norm

    def recording_global_norm(dist_squares, not_dist_squares):
        reduce_norm(dist_squares, not_dist_squares)
        clip.last_norm = paddle.sqrt(dist_squares + not_dist_squares)

    hybrid._global_norm = recording_global_norm
