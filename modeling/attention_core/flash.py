"""The flash attention core: Paddle's FlashAttention-2 kernel, called as PaddleNLP's LLaMA calls it
(`F.scaled_dot_product_attention(q, k, v, is_causal=True)` on [batch, seq, heads, head_dim], no mask
built, kv heads not repeated), under bf16/fp16 on a GPU; a windowed layer through Paddle's
`flashmask_attention(..., causal=True, window_size=window - 1)` (its query i sees keys i - w..i, so
transformers' window W is w = W - 1), as PaddleFormers drives it.

Paddle's own dispatcher falls back silently to its memory-efficient kernel or to the math path
(which keeps every score) when flash does not apply, so `flash_refusal` applies Paddle 3.3.1's
rules before the model is built (`paddle.nn.functional.sdpa.can_use_flash_attention`: a CUDA GPU of
SM 8.0-12.1, fp16/bf16, head_dim at most 256 and a multiple of 8, causal with equal lengths) and
the run takes the blockwise core where they fail. Per layer, `spec_refusal` names what Paddle
3.3.1's FlashAttention-2 cannot compute (a soft-cap, an ALiBi bias, sinks, v narrower than q and
k): such a layer takes the blockwise core and the run says so. Its softmax scale cannot be passed
(FA-2 asserts on `softmax_scale`), so q is pre-scaled. Untested here: no GPU reachable; the
selection and the activation model are tested on CPU.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F
from paddle import _C_ops

from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.documents import Documents

FP32 = "float32"

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


FLASH_HEAD_DIM = 256  # FlashAttention-2's largest head size (Gemma 4's full layers have 512)


def spec_refusal(spec: CoreSpec, sinks: bool, qk_dim: int, v_dim: int) -> str | None:
    """What of a layer's attention Paddle 3.3.1's FlashAttention-2 does not compute, or None."""
    if spec.softcap is not None:
        return f"a soft-cap of {spec.softcap} (FlashAttention-2 in Paddle 3.3.1 has none)"
    if spec.alibi is not None:
        return "ALiBi (the kernel takes no bias)"
    if sinks:
        return "attention sinks (not wired to Paddle's kernel here)"
    if v_dim != qk_dim:
        return f"v head size {v_dim} unlike q/k's {qk_dim} (the kernel needs equal ones)"
    if qk_dim > FLASH_HEAD_DIM:
        return f"a head size of {qk_dim} (FlashAttention-2 computes at most {FLASH_HEAD_DIM})"
    return None


def _prescaled(q, spec: CoreSpec):
    """q times the layer's scale over the kernel's own head_dim^-1/2 (FA-2 takes no scale)."""
    scale = spec.softmax_scale(q.shape[-1]) * math.sqrt(q.shape[-1])
    return q if spec.scale is None else q * scale


def flash_causal_attention(q, k, v, seq_first: bool = False, spec: CoreSpec = PLAIN, window: int | None = None,
                           documents: Documents | None = None):
    """As `dense_causal_attention`, through Paddle's flash kernel (sequence-first inputs transposed to
    the kernel's batch-first layout and the output back); `window` the layer's, where shorter than
    the sequence. Per-document attention passes flashmask the row each key stops being seen at (its
    document's end, or sooner by the window), as PaddleFormers passes `attn_mask_startend_row_indices`."""
    if seq_first:
        q, k, v = (t.transpose([1, 0, 2, 3]) for t in (q, k, v))
    q = _prescaled(q, spec)
    if documents is not None:
        out = F.flashmask_attention(q, k, v, documents.key_ends(window), causal=True, training=True)
    elif window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, training=True)
    else:
        out = F.flashmask_attention(q, k, v, causal=True, window_size=window - 1, training=True)
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


class RingKernel:
    """Paddle's flash kernel computing one block of ring attention (GPU, bf16/fp16; untested here):
    everything [batch, seq, heads, head_dim], positions on axis 1, the log-sum-exp [batch, seq, heads,
    1] while merging and [batch, heads, seq] for the kernel, as PaddleNLP's ring keeps them; the
    layer's scale folded into q (the kernel takes none). Layers with a soft-cap or sinks take the
    blockwise kernel (`spec_refusal`)."""

    axis = 1

    def __init__(self, q_shape, kv_heads: int, v_dim: int, seq_first: bool, block: int, spec: CoreSpec):
        self.heads, self.head_dim, self.seq_first = q_shape[2], q_shape[3], seq_first
        self.scale = spec.softmax_scale(self.head_dim) * math.sqrt(self.head_dim)

    def _batch_first(self, t):
        return t.transpose([1, 0, 2, 3]) if self.seq_first else t

    def queries(self, t, scaled: bool = False):
        rows = self._batch_first(t.reshape(t.shape[:2] + [self.heads, self.head_dim]))
        return rows * self.scale if scaled and self.scale != 1.0 else rows

    outputs = queries
    keys = _batch_first

    def attend(self, q, k, v, causal: bool, documents: None = None):
        if documents is not None:  # flash_attn has no per-call mask: `ring_attention` sends these to blockwise
            raise ValueError("the flash ring kernel cannot keep attention inside documents")
        out, lse = flash_block(q, k, v, causal)
        return out.astype(FP32), lse.transpose([0, 2, 1]).unsqueeze(-1)

    def attend_backward(self, q, k, v, out, lse, dout, causal: bool, documents: None = None):
        grads = flash_block_backward(q, k, v, out.astype(q.dtype), lse.squeeze(-1).transpose([0, 2, 1]).contiguous(),
                                     dout, causal)
        return [grad.astype(FP32) for grad in grads]

    def output(self, out, dtype):
        out = out.astype(dtype)
        out = out.reshape(out.shape[:2] + [-1])
        return out.transpose([1, 0, 2]) if self.seq_first else out

    def query_grad(self, dq, like):
        dq = dq * self.scale if self.scale != 1.0 else dq
        return self._batch_first(dq.astype(like.dtype))

    def key_grad(self, grad, like):
        return self._batch_first(grad.astype(like.dtype))
