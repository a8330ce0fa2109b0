"""Causal scaled dot-product attention on per-rank heads, shared by every model family."""

from __future__ import annotations

import functools
import math

import paddle
import paddle.nn.functional as F


@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int) -> paddle.Tensor:
    """[1, 1, seq, seq], True where a query may attend (built once per length: it is a constant)."""
    return paddle.tril(paddle.ones([seq_len, seq_len], dtype="bool"))[None, None]


def causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool = False) -> paddle.Tensor:
    """q, k, v [batch, seq, heads, head_dim] -> [batch, seq, heads * head_dim]; softmax in fp32.
    With `seq_first` (sequence parallelism) both are [seq, batch, ...]: the one transpose to
    [batch, heads, seq, head_dim] each side absorbs the layout, so it costs no extra copy."""
    if seq_first:
        seq, batch, heads, head_dim = q.shape
        q, k, v = (t.transpose([1, 2, 0, 3]) for t in (q, k, v))
    else:
        batch, seq, heads, head_dim = q.shape
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = paddle.matmul(q * (1 / math.sqrt(head_dim)), k.transpose([0, 1, 3, 2]))
    # masked scores become the dtype's minimum, as adding an additive mask gives, at half the cost
    scores = paddle.where(causal_mask(seq), scores, paddle.full([], paddle.finfo(scores.dtype).min, scores.dtype))
    probs = F.softmax(scores.astype("float32"), axis=-1).astype(q.dtype)
    out = paddle.matmul(probs, v)  # [batch, heads, seq, head_dim]
    if seq_first:
        return out.transpose([2, 0, 1, 3]).reshape([seq, batch, heads * head_dim])
    return out.transpose([0, 2, 1, 3]).reshape([batch, seq, heads * head_dim])


FP32_BYTES = 4  # the softmax (and the norms' statistics) stay fp32 whatever the compute dtype


def causal_attention_saved_bytes(batch: int, seq_len: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What `causal_attention` keeps for backward on `heads` local heads: the scaled q, k and v,
    the fp32 probabilities and the boolean causal mask (the planner's activation model, tested
    equal to the measured bytes)."""
    scores = batch * heads * seq_len * seq_len
    return 3 * batch * seq_len * heads * head_dim * dtype_bytes + scores * (FP32_BYTES + 1)
