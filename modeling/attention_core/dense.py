"""The dense attention core: every score of a sequence at once, the fp32 probabilities kept for
backward (seq^2 per head). The reference the other cores are tested against (itself checked
against transformers' eager attention), and what PaddleNLP computes without flash attention. The
layer's `CoreSpec` is applied as transformers' eager attention applies it: scale, soft-cap, ALiBi
bias, then the causal and window mask; sinks as one more column of the softmax, dropped after."""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn.functional as F

from modeling.attention_core.blockwise import _alibi, from_rows, sink_rows, to_heads, to_rows
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.autocast import full_precision
from modeling.documents import Documents

FP32_BYTES = 4


@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int, groups: int, window: int | None = None) -> paddle.Tensor:
    """[seq x groups, seq], True where query row r (position r // groups) may attend key c (built once
    per length: a constant)."""
    rows = np.arange(seq_len * groups)[:, None] // groups
    keys = np.arange(seq_len)[None, :]
    visible = rows >= keys
    if window is not None:
        visible &= keys > rows - window
    return paddle.to_tensor(visible)


def dense_causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool = False,
                           spec: CoreSpec = PLAIN, sinks: paddle.Tensor | None = None,
                           documents: Documents | None = None) -> paddle.Tensor:
    """q [batch, seq, heads, qk_dim], k [batch, seq, kv_heads, qk_dim], v [.., kv_heads, v_dim] (or
    all sequence first) -> [batch, seq, heads x v_dim] (or sequence first); softmax in fp32. Each kv
    head's query heads are rows of one matmul (`blockwise.to_rows`), so k and v are not repeated.
    With `documents`, each query sees only its own document's keys (the mask is then per batch row)."""
    kv_heads, head_dim = k.shape[2], q.shape[3]
    groups, seq = q.shape[2] // kv_heads, q.shape[0 if seq_first else 1]
    rows = to_rows(q, kv_heads, seq_first) * spec.softmax_scale(head_dim)
    scores = paddle.matmul(rows, to_heads(k, seq_first), transpose_y=True)  # [batch, kv_heads, seq x groups, seq]
    if spec.softcap is not None:
        scores = paddle.tanh(scores / spec.softcap) * spec.softcap
    if spec.alibi is not None:
        scores = scores + _alibi(0, seq, seq, groups, spec.alibi).astype(scores.dtype)
    # masked scores become the dtype's minimum, as adding an additive mask gives, at half the cost
    lowest = paddle.full([], paddle.finfo(scores.dtype).min, scores.dtype)
    visible = causal_mask(seq, groups, spec.window_within(seq))
    if documents is not None:
        visible = paddle.logical_and(visible, documents.visible(groups))
    scores = paddle.where(visible, scores, lowest)
    with full_precision():  # O2 would run the softmax in bf16 (as PaddleNLP's LLaMA avoids)
        wide = scores.astype("float32")
        if sinks is None:
            probs = F.softmax(wide, axis=-1).astype(v.dtype)
        else:
            column = sink_rows(sinks, kv_heads, seq).expand(wide.shape[:3] + [1])
            probs = F.softmax(paddle.concat([wide, column], axis=-1), axis=-1)[..., :seq].astype(v.dtype)
    return from_rows(paddle.matmul(probs, to_heads(v, seq_first)), groups, seq_first)
