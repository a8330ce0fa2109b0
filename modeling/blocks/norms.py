"""RMSNorm (LLaMA's, and Gemma's `1 + weight` form) and the bytes a norm keeps for backward."""

from __future__ import annotations

import paddle
from paddle import nn

from modeling.autocast import full_precision

FP32_BYTES = 4  # the norms' statistics (and the softmax) stay fp32 whatever the compute dtype


class RMSNorm(nn.Layer):
    """x / rms(x) * scale over the last axis, statistics in fp32. The scale is `weight`, or with
    `offset` (Gemma) `1 + weight`, applied in fp32 before the cast back as transformers' Gemma does
    (LLaMA casts first, then scales). Used over the hidden size and, for q/k norms, over a head."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = self.create_parameter(
            shape=[dim], default_initializer=nn.initializer.Constant(0.0 if offset else 1.0))
        self.eps, self.offset = eps, offset

    def forward(self, hidden):
        # autocast off and the statistics in fp32, as in PaddleNLP's LLaMA: O2 would run them in bf16
        # (the cast is free in fp32: astype to the same dtype returns the tensor itself). Square, not
        # pow(2), and the big operand first in the broadcast product: 7x faster with backward on CPU.
        with full_precision():
            wide = hidden.astype("float32")
            normed = wide * paddle.rsqrt(paddle.square(wide).mean(-1, keepdim=True) + self.eps)
            if self.offset:
                return (normed * (1.0 + self.weight.astype("float32"))).astype(hidden.dtype)
        return normed.astype(self.weight.dtype) * self.weight


def rms_norm_saved_bytes(tokens: int, dim: int, dtype_bytes: int, offset: bool, rows: int = 1) -> int:
    """What `RMSNorm` keeps for backward over `tokens` x `rows` vectors of `dim`: its input, the
    normalised input and 1/rms per vector (fp32), and under `offset` the fp32 `1 + weight`."""
    vectors = tokens * rows
    return 2 * vectors * dim * dtype_bytes + vectors * FP32_BYTES + (dim * FP32_BYTES if offset else 0)


def layer_norm_saved_bytes(tokens: int, dim: int, dtype_bytes: int) -> int:
    """What Paddle's LayerNorm keeps for backward: its input, mean and variance (fp32)."""
    return tokens * dim * dtype_bytes + 2 * tokens * FP32_BYTES
