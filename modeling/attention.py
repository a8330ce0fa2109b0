"""Causal scaled dot-product attention on per-rank heads, shared by every model family."""

from __future__ import annotations

import math

import paddle
import paddle.nn.functional as F


def causal_mask(seq_len: int, dtype) -> paddle.Tensor:
    """Additive mask [1, 1, seq, seq]: 0 where a query may attend, the dtype's minimum elsewhere."""
    allowed = paddle.tril(paddle.ones([seq_len, seq_len], dtype="bool"))
    return paddle.where(allowed, paddle.zeros([], "float32"), paddle.full([], paddle.finfo(dtype).min, "float32")
                        ).astype(dtype)[None, None]


def causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
    """q, k, v [batch, seq, heads, head_dim] -> [batch, seq, heads * head_dim]; softmax in fp32."""
    batch, seq, heads, head_dim = q.shape
    q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = paddle.matmul(q * (1 / math.sqrt(head_dim)), k.transpose([0, 1, 3, 2]))
    scores = scores + causal_mask(seq, scores.dtype)
    probs = F.softmax(scores.astype("float32"), axis=-1).astype(q.dtype)
    return paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([batch, seq, heads * head_dim])
