"""The dense attention core: every score of a sequence at once, the fp32 probabilities kept for
backward (seq^2 per head). The reference the other cores are tested against, and what PaddleNLP
computes without flash attention."""

from __future__ import annotations

import functools
import math

import numpy as np
import paddle
import paddle.nn.functional as F

from modeling.attention_core.blockwise import from_rows, to_heads, to_rows
from modeling.autocast import full_precision

FP32_BYTES = 4


@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int, groups: int) -> paddle.Tensor:
    """[seq x groups, seq], True where query row r (position r // groups) may attend key c (built once
    per length: a constant)."""
    rows = np.arange(seq_len * groups) // groups
    return paddle.to_tensor(rows[:, None] >= np.arange(seq_len)[None, :])


def dense_causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor,
                           seq_first: bool = False) -> paddle.Tensor:
    """q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (or all sequence first)
    -> [batch, seq, heads x head_dim] (or sequence first); softmax in fp32. Each kv head's query heads
    are rows of one matmul (`blockwise.to_rows`), so k and v are not repeated."""
    kv_heads, head_dim = k.shape[2], q.shape[3]
    groups, seq = q.shape[2] // kv_heads, q.shape[0 if seq_first else 1]
    rows = to_rows(q, kv_heads, seq_first) * (1 / math.sqrt(head_dim))
    scores = paddle.matmul(rows, to_heads(k, seq_first), transpose_y=True)  # [batch, kv_heads, seq x groups, seq]
    # masked scores become the dtype's minimum, as adding an additive mask gives, at half the cost
    lowest = paddle.full([], paddle.finfo(scores.dtype).min, scores.dtype)
    scores = paddle.where(causal_mask(seq, groups), scores, lowest)
    with full_precision():  # O2 would run the softmax in bf16 (as PaddleNLP's LLaMA avoids)
        probs = F.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
    return from_rows(paddle.matmul(probs, to_heads(v, seq_first)), groups, seq_first)
