"""The flash attention core: Paddle's FlashAttention-2 kernel, called as PaddleNLP's LLaMA calls it
(`F.scaled_dot_product_attention(q, k, v, is_causal=True)` on [batch, seq, heads, head_dim], no mask
built, kv heads not repeated), under bf16/fp16 on a GPU.

Paddle's own dispatcher falls back silently to its memory-efficient kernel or to the math path
(which keeps every score) when flash does not apply, so `flash_refusal` applies Paddle 3.3.1's
rules before the model is built (`paddle.nn.functional.sdpa.can_use_flash_attention`: a CUDA GPU of
SM 8.0-12.1, fp16/bf16, head_dim at most 256 and a multiple of 8, causal with equal lengths) and
the run takes the blockwise core where they fail. Untested here: no GPU reachable; the selection
and the activation model are tested on CPU.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import _C_ops

FLASH_DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 8
SM_RANGE = ((8, 0), (12, 1))  # Paddle 3.3.1's sdpa _config["flash_attn"] MINIMUM/MAXIMUM_SM_VERSION
LSE_ROW_MULTIPLE = 128  # FA2 keeps its fp32 log-sum-exp per head over the query length rounded up to this


def flash_refusal(device: str, dtype: str | None, head_dim: int, sm: tuple[int, int] | None) -> str | None:
    """Why Paddle's flash kernel would not run this attention, or None when it does."""
    if device != "gpu":
        return f"no CUDA GPU (device {device})"
    if dtype not in FLASH_DTYPES:
        return f"compute dtype {dtype or 'float32'} (flash needs float16 or bfloat16: --bf16 or --fp16)"
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE:
        return f"head_dim {head_dim} (flash needs at most {MAX_HEAD_DIM} and a multiple of {HEAD_DIM_MULTIPLE})"
    if sm is not None and not SM_RANGE[0] <= tuple(sm) <= SM_RANGE[1]:
        return f"GPU compute capability {sm[0]}.{sm[1]} (flash needs {SM_RANGE[0]} to {SM_RANGE[1]})"
    return None


def flash_causal_attention(q, k, v, seq_first: bool = False):
    """As `dense_causal_attention`, through Paddle's flash kernel (sequence-first inputs transposed to
    the kernel's batch-first layout and the output back)."""
    if seq_first:
        q, k, v = (t.transpose([1, 0, 2, 3]) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, training=True)
    batch, seq = out.shape[:2]
    out = out.reshape([batch, seq, -1])
    return out.transpose([1, 0, 2]) if seq_first else out


def flash_block(q, k, v, causal: bool):
    """(output, fp32 log-sum-exp [batch, heads, seq]) of one block of ring attention, q [batch, seq,
    heads, head_dim] against k, v [batch, seq, kv_heads, head_dim]: Paddle's `_C_ops.flash_attn`, called
    as Paddle's own ring attention calls it (paddle/distributed/auto_parallel/ring_attention.py; its
    PaddleNLP twin needs the paddlenlp_ops build for backward), the log-sum-exp cut to the query length."""
    out, _, lse, _ = _C_ops.flash_attn(q, k, v, None, None, 0.0, causal, False, False, "")
    return out, lse[:, :, :q.shape[1]]


def flash_block_backward(q, k, v, out, lse, dout, causal: bool):
    """(dq, dk, dv) of `flash_block` given the merged output and log-sum-exp: `_C_ops.flash_attn_grad`."""
    seed_offset = paddle.to_tensor([0, 0], place=paddle.CPUPlace(), dtype="int64")
    return _C_ops.flash_attn_grad(q, k, v, out, lse, seed_offset, None, dout, 0.0, causal)
