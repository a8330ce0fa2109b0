"""The blockwise attention core: FlashAttention-2's algorithm (Dao, 2023) in plain Paddle ops, so that
what attention keeps for backward grows with the sequence instead of its square, on any device.

Forward walks key blocks with an online softmax (running row maximum, running sum, rescaled
accumulator) and keeps only q, k, v, the output and one fp32 log-sum-exp per query row; backward
recomputes each block's probabilities from the log-sum-exp. Scores, probabilities and the causal
mask exist one block at a time, so a step's transient memory is a few blocks, not seq x seq.

Grouped-query attention stays inside: queries are laid out as rows [batch, kv_heads, seq x groups,
head_dim] (row r is position r // groups, query head r % groups of its kv head's group) against k
and v as [batch, kv_heads, seq, head_dim], so every block is one batched matmul per kv head and k
and v are never repeated. `attend` and `attend_backward` return and take the log-sum-exp so that
context parallelism can merge partial results across ranks.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.autocast import full_precision

FP32 = "float32"
DEFAULT_BLOCK = 512  # query and key positions per block: 512 x 512 fp32 scores per (batch, kv head, group)


@functools.lru_cache(maxsize=16)
def _diagonal_mask(positions: int, groups: int) -> paddle.Tensor:
    """[positions x groups, positions] fp32: 0 where query row r (position r // groups) may see key c,
    -inf where it may not (added to the scores: every row keeps its own position, so its maximum is
    finite and the masked terms become exp(-inf) = 0)."""
    rows = np.arange(positions * groups) // groups
    return paddle.to_tensor(np.where(rows[:, None] >= np.arange(positions)[None, :], 0.0, -np.inf).astype(np.float32))


def to_rows(q: paddle.Tensor, kv_heads: int, seq_first: bool) -> paddle.Tensor:
    """q [batch, seq, heads, head_dim] (or [seq, batch, ...]) -> rows [batch, kv_heads, seq x groups, head_dim]."""
    lead = q.shape[:2]
    batch, seq = (lead[1], lead[0]) if seq_first else lead
    heads, head_dim = q.shape[2:]
    grouped = q.reshape(lead + [kv_heads, heads // kv_heads, head_dim])
    grouped = grouped.transpose([1, 2, 0, 3, 4] if seq_first else [0, 2, 1, 3, 4])
    return grouped.reshape([batch, kv_heads, seq * (heads // kv_heads), head_dim])


def to_heads(x: paddle.Tensor, seq_first: bool) -> paddle.Tensor:
    """k or v [batch, seq, kv_heads, head_dim] (or sequence first) -> [batch, kv_heads, seq, head_dim]."""
    return x.transpose([1, 2, 0, 3] if seq_first else [0, 2, 1, 3])


def from_rows(rows: paddle.Tensor, groups: int, seq_first: bool) -> paddle.Tensor:
    """rows [batch, kv_heads, seq x groups, head_dim] -> [batch, seq, heads x head_dim] (or sequence first)."""
    batch, kv_heads, count, head_dim = rows.shape
    seq = count // groups
    grouped = rows.reshape([batch, kv_heads, seq, groups, head_dim])
    grouped = grouped.transpose([2, 0, 1, 3, 4] if seq_first else [0, 2, 1, 3, 4])
    return grouped.reshape(([seq, batch] if seq_first else [batch, seq]) + [kv_heads * groups * head_dim])


def _scores(q_block, k_block, causal_diagonal: bool, groups: int) -> paddle.Tensor:
    """fp32 scores of a query block against a key block; on the causal diagonal, later keys masked."""
    scores = paddle.matmul(q_block, k_block, transpose_y=True).astype(FP32)
    return scores + _diagonal_mask(k_block.shape[2], groups) if causal_diagonal else scores


def _key_blocks(start: int, stop: int, block: int):
    return [(j, min(j + block, stop)) for j in range(start, stop, block)]


def _joined(blocks: list[paddle.Tensor]) -> paddle.Tensor:
    """Blocks along the rows, without a copy when there is one."""
    return blocks[0] if len(blocks) == 1 else paddle.concat(blocks, axis=2)


def attend(q_rows: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, groups: int, causal: bool,
           block: int = DEFAULT_BLOCK, out_dtype: str | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(output rows in `out_dtype` (default q's), fp32 log-sum-exp [batch, kv_heads, rows, 1]) of
    already scaled query rows against k and v. `causal`: queries and keys are the same positions and
    a query sees keys up to its own; otherwise every key."""
    seq_q, seq_k = q_rows.shape[2] // groups, k.shape[2]
    outputs, sums = [], []
    for i0, i1 in _key_blocks(0, seq_q, block):
        q_block = q_rows[:, :, i0 * groups:i1 * groups]
        high = acc = total = None
        for j0, j1 in _key_blocks(0, i1 if causal else seq_k, block):
            scores = _scores(q_block, k[:, :, j0:j1], causal and j0 == i0, groups)
            block_high = scores.max(-1, keepdim=True)
            new_high = block_high if high is None else paddle.maximum(high, block_high)
            probs = paddle.exp(scores - new_high)
            values = paddle.matmul(probs.astype(v.dtype), v[:, :, j0:j1]).astype(FP32)
            if high is None:
                total, acc = probs.sum(-1, keepdim=True), values
            else:
                rescale = paddle.exp(high - new_high)
                total, acc = total * rescale + probs.sum(-1, keepdim=True), acc * rescale + values
            high = new_high
        outputs.append((acc / total).astype(out_dtype or q_rows.dtype))
        sums.append(high + paddle.log(total))
    return _joined(outputs), _joined(sums)


def attend_backward(q_rows, k, v, out_rows, lse, dout_rows, groups: int, causal: bool,
                    block: int = DEFAULT_BLOCK) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Gradients (of the scaled query rows, k, v) of `attend`, each block's probabilities recomputed
    from the log-sum-exp: FlashAttention-2's backward, key blocks outside, query blocks inside."""
    seq_q, seq_k = q_rows.shape[2] // groups, k.shape[2]
    delta = (dout_rows.astype(FP32) * out_rows.astype(FP32)).sum(-1, keepdim=True)
    query_blocks = _key_blocks(0, seq_q, block)
    dq = [None] * len(query_blocks)
    dk, dv = [], []
    for j0, j1 in _key_blocks(0, seq_k, block):
        k_block, v_block = k[:, :, j0:j1], v[:, :, j0:j1]
        dk_block = dv_block = None
        for n, (i0, i1) in enumerate(query_blocks):
            if causal and i1 <= j0:
                continue
            rows = slice(i0 * groups, i1 * groups)
            q_block, dout_block = q_rows[:, :, rows], dout_rows[:, :, rows]
            probs = paddle.exp(_scores(q_block, k_block, causal and j0 == i0, groups) - lse[:, :, rows])
            dv_part = paddle.matmul(probs.astype(v.dtype), dout_block, transpose_x=True).astype(FP32)
            dprobs = paddle.matmul(dout_block, v_block, transpose_y=True).astype(FP32)
            dscores = (probs * (dprobs - delta[:, :, rows])).astype(q_rows.dtype)
            dq_part = paddle.matmul(dscores, k_block).astype(FP32)
            dk_part = paddle.matmul(dscores, q_block, transpose_x=True).astype(FP32)
            dq[n] = dq_part if dq[n] is None else dq[n] + dq_part
            dk_block = dk_part if dk_block is None else dk_block + dk_part
            dv_block = dv_part if dv_block is None else dv_block + dv_part
        dk.append(dk_block)
        dv.append(dv_block)
    return _joined(dq).astype(q_rows.dtype), _joined(dk).astype(k.dtype), _joined(dv).astype(v.dtype)


class _BlockwiseAttention(PyLayer):
    """Causal attention of q [.., heads, head_dim] on k, v [.., kv_heads, head_dim]. Keeps q, k, v as
    given, the output it returns (the output projection keeps the same tensor) and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, seq_first: bool, block: int):
        kv_heads, head_dim = k.shape[2], q.shape[3]
        groups, scale = q.shape[2] // kv_heads, 1 / math.sqrt(head_dim)
        with full_precision():
            out_rows, lse = attend(to_rows(q, kv_heads, seq_first) * scale, to_heads(k, seq_first),
                                   to_heads(v, seq_first), groups, True, block)
            out = from_rows(out_rows, groups, seq_first)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = (seq_first, block, groups, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        seq_first, block, groups, scale = ctx.layout
        kv_heads, head_dim = k.shape[2], q.shape[3]
        as_rows = lambda t: to_rows(t.reshape(t.shape[:2] + [-1, head_dim]), kv_heads, seq_first)  # noqa: E731
        with full_precision():
            dq_rows, dk, dv = attend_backward(as_rows(q) * scale, to_heads(k, seq_first), to_heads(v, seq_first),
                                              as_rows(out), lse, as_rows(dout), groups, True, block)
            dq = from_rows(dq_rows * scale, groups, seq_first).reshape(q.shape)
            back = [2, 0, 1, 3] if seq_first else [0, 2, 1, 3]
            return dq, dk.transpose(back), dv.transpose(back)


def blockwise_causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool = False,
                               block: int = DEFAULT_BLOCK) -> paddle.Tensor:
    """q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (or all sequence first)
    -> [batch, seq, heads x head_dim] (or sequence first)."""
    return _BlockwiseAttention.apply(q, k, v, seq_first, block)
