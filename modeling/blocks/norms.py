"""RMSNorm (LLaMA's, and Gemma's `1 + weight` form) and the bytes a norm keeps for backward."""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.distributed import collective

from modeling.autocast import full_precision

FP32_BYTES = 4  # the norms' statistics (and the softmax) stay fp32 whatever the compute dtype


class RMSNorm(nn.Layer):
    """x / rms(x) * scale over the last axis, statistics in fp32. The scale is `weight`, or with
    `offset` (Gemma) `1 + weight`, applied in fp32 before the cast back as transformers' Gemma does
    (LLaMA casts first, then scales). Used over the hidden size and, for q/k norms, over a head.
    `fused` (a GPU run's --use_fused_rms_norm; not for the `1 + weight` form) calls Paddle's
    `fused_rms_norm` kernel instead, statistics in fp32 as here (never on CPU: it dies of SIGILL on
    AVX2 CPUs; untested here)."""

    def __init__(self, dim: int, eps: float, offset: bool = False, fused: bool = False):
        super().__init__()
        self.weight = self.create_parameter(
            shape=[dim], default_initializer=nn.initializer.Constant(0.0 if offset else 1.0))
        self.eps, self.offset, self.fused = eps, offset, fused and not offset

    def forward(self, hidden):
        if self.fused:
            from paddle.incubate.nn.functional import fused_rms_norm

            return fused_rms_norm(hidden, self.weight, None, self.eps, hidden.ndim - 1)[0]
        # autocast off and the statistics in fp32, as in PaddleNLP's LLaMA: O2 would run them in bf16
        # (the cast is free in fp32: astype to the same dtype returns the tensor itself). Square, not
        # pow(2), and the big operand first in the broadcast product: 7x faster with backward on CPU.
        with full_precision():
            wide = hidden.astype("float32")
            normed = wide * paddle.rsqrt(self.mean_square(wide) + self.eps)
            if self.offset:
                return (normed * (1.0 + self.weight.astype("float32"))).astype(hidden.dtype)
        return normed.astype(self.weight.dtype) * self.weight

    def mean_square(self, wide: paddle.Tensor) -> paddle.Tensor:
        return paddle.square(wide).mean(-1, keepdim=True)


class SplitRMSNorm(RMSNorm):
    """RMSNorm over a vector whose entries are split over tp ranks in equal blocks (OLMoE's q/k
    norms over the whole q and k projections, which tp splits by heads): each rank scales its block
    by its block of the weight, with the mean square of the whole vector, summed over the ranks
    forward and backward (each rank's block of the loss depends on every rank's entries)."""

    def __init__(self, dim: int, eps: float, tp_group):
        super().__init__(dim // tp_group.nranks, eps)
        self.full_dim, self.tp_group = dim, tp_group
        # as fleet's parallel layers mark theirs: no broadcast over tp, a square per rank in the global norm
        self.weight.is_distributed, self.weight.split_axis = True, 0

    def mean_square(self, wide: paddle.Tensor) -> paddle.Tensor:
        local = paddle.square(wide).sum(-1, keepdim=True)
        whole = collective._mp_allreduce(collective._c_identity(local, group=self.tp_group), group=self.tp_group)
        return whole / self.full_dim


class GroupRMSNorm(RMSNorm):
    """RMSNorm over each `group_size` entries of the last axis (Mamba-2's gated norm: one group per
    B/C group of heads), a weight over all of them; tp splits whole groups (`distributed`), so each
    rank's statistics are complete. The cast before the scale is LLaMA's, as transformers' gated norm."""

    def __init__(self, dim: int, eps: float, group_size: int, distributed: bool):
        super().__init__(dim, eps)
        self.group_size = group_size
        if distributed:
            self.weight.is_distributed, self.weight.split_axis = True, 0

    def forward(self, hidden):
        shape = hidden.shape
        with full_precision():
            wide = hidden.astype("float32").reshape(shape[:-1] + [-1, self.group_size])
            normed = (wide * paddle.rsqrt(self.mean_square(wide) + self.eps)).reshape(shape)
        return normed.astype(self.weight.dtype) * self.weight


def rms_norm_saved_bytes(tokens: int, dim: int, dtype_bytes: int, offset: bool, rows: int = 1,
                         fused: bool = False) -> int:
    """What `RMSNorm` keeps for backward over `tokens` x `rows` vectors of `dim`: its input, the
    normalised input and 1/rms per vector (fp32), and under `offset` the fp32 `1 + weight`. Paddle's
    fused kernel keeps the input and 1/rms only (read in its backward's signature, not run)."""
    vectors = tokens * rows
    if fused and not offset:
        return vectors * dim * dtype_bytes + vectors * FP32_BYTES
    return 2 * vectors * dim * dtype_bytes + vectors * FP32_BYTES + (dim * FP32_BYTES if offset else 0)


def layer_norm_saved_bytes(tokens: int, dim: int, dtype_bytes: int) -> int:
    """What Paddle's LayerNorm keeps for backward: its input, mean and variance (fp32)."""
    return tokens * dim * dtype_bytes + 2 * tokens * FP32_BYTES
