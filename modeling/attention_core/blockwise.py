"""The blockwise attention core: FlashAttention-2's algorithm (Dao, 2023) in plain Paddle ops, so that
what attention keeps for backward grows with the sequence instead of its square, on any device.

Forward walks key blocks with an online softmax (running row maximum, running sum, rescaled
accumulator) and keeps only q, k, v, the output and one fp32 log-sum-exp per query row; backward
recomputes each block's probabilities from the log-sum-exp. Scores, probabilities and masks exist
one block at a time, so a step's transient memory is a few blocks, not seq x seq.

The layer's `CoreSpec` is honoured block by block: a sliding window skips every key block wholly
older than it (a windowed layer costs O(seq x window), not O(seq^2)) and masks the edge blocks; a
soft-cap is applied to each block's scores in forward and its derivative (1 - tanh^2) in backward;
ALiBi adds its bias per block (no seq x seq bias tensor); the scale is folded into the queries.
Per-document attention (`modeling/documents.py`) works the same way: key blocks wholly before every
row's document are skipped, and a block a document boundary crosses is masked per batch row.
Sinks (one value-less logit per head) are applied once after the online softmax: the row's
log-sum-exp becomes L = logaddexp(lse, sink) and the output is rescaled by exp(lse - L); the
backward below is exact given L and the final output, and the sink's own gradient is
-sum_rows exp(sink - L) x rowsum(dO * O). v may be narrower or wider than q and k.

Grouped-query attention stays inside: queries are laid out as rows [batch, kv_heads, seq x groups,
head_dim] (row r is position r // groups, query head r % groups of its kv head's group) against k
and v as [batch, kv_heads, seq, head_dim], so every block is one batched matmul per kv head and k
and v are never repeated. `attend` and `attend_backward` return and take the log-sum-exp so that
context parallelism can merge partial results across ranks.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.autocast import full_precision
from modeling.documents import Documents
from modeling.saved_tensors import kept
from paddle_pp.runtime.normal_range import exp_normal, flush_subnormals_

FP32 = "float32"
DEFAULT_BLOCK = 512  # query and key positions per block: 512 x 512 fp32 scores per (batch, kv head, group)


@functools.lru_cache(maxsize=64)
def _relative(offset: int, queries: int, keys: int, groups: int) -> np.ndarray:
    """[queries x groups, keys]: key position minus query position, for a query block starting
    `offset` positions after its key block (row r is query position r // groups)."""
    rows = np.arange(queries * groups) // groups + offset
    return np.arange(keys)[None, :] - rows[:, None]


@functools.lru_cache(maxsize=64)
def _mask(offset: int, queries: int, keys: int, groups: int, causal: bool, window: int | None) -> paddle.Tensor:
    """fp32 [queries x groups, keys]: 0 where the row may see the key, -inf where it may not (added to
    the scores: every row keeps its own position, so its maximum is finite and the masked terms become
    exp(-inf) = 0)."""
    relative = _relative(offset, queries, keys, groups)
    visible = np.ones_like(relative, dtype=bool)
    if causal:
        visible &= relative <= 0
    if window is not None:
        visible &= relative > -window
    return paddle.to_tensor(np.where(visible, 0.0, -np.inf).astype(np.float32))


@functools.lru_cache(maxsize=64)
def _alibi(offset: int, queries: int, keys: int, groups: int, slopes: tuple[float, ...]) -> paddle.Tensor:
    """fp32 [kv_heads, queries x groups, keys]: slope of the row's head x (key - query position)."""
    per_row = np.tile(np.asarray(slopes, np.float64).reshape(-1, groups), (1, queries))  # [kv_heads, rows]
    return paddle.to_tensor((per_row[:, :, None] * _relative(offset, queries, keys, groups)[None]).astype(np.float32))


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


def sink_rows(sinks: paddle.Tensor, kv_heads: int, seq: int) -> paddle.Tensor:
    """Per-head sink logits [heads] as a column over the rows [1, kv_heads, seq x groups, 1] (fp32)."""
    return sinks.astype(FP32).reshape([1, kv_heads, 1, -1]).tile([1, 1, seq, 1]).reshape([1, kv_heads, -1, 1])


class Blocks:
    """The key blocks each query block meets, and what each (query block, key block) pair adds to
    its scores, for one call's geometry, spec and documents (per-document attention, causal only)."""

    def __init__(self, seq_q: int, seq_k: int, groups: int, causal: bool, block: int, spec: CoreSpec,
                 documents: Documents | None = None):
        self.seq_q, self.seq_k, self.groups, self.causal, self.block = seq_q, seq_k, groups, causal, block
        self.window = spec.window_within(seq_k) if causal else None
        self.softcap, self.alibi = spec.softcap, spec.alibi
        self.documents = documents

    def queries(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.block, self.seq_q)) for i in range(0, self.seq_q, self.block)]

    def keys_for(self, i0: int, i1: int) -> list[tuple[int, int]]:
        """The key blocks some query of [i0, i1) sees (causal: none later than i1 - 1; windowed: none
        wholly older than i0 - window + 1; per document: none wholly before every row's document)."""
        stop = i1 if self.causal else self.seq_k
        oldest = i0 - self.window + 1 if self.window is not None else 0
        if self.documents is not None:
            oldest = max(oldest, self.documents.oldest_key(i0))
        return [(j, min(j + self.block, stop)) for j in range(0, stop, self.block) if min(j + self.block, stop) > oldest]

    def _masked(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        return (self.causal and j1 - 1 > i0) or (self.window is not None and j0 <= i1 - 1 - self.window)

    def scores(self, q_block, k_block, i0: int, i1: int, j0: int, j1: int):
        """(fp32 scores of a query block against a key block as the softmax sees them, tanh of the
        capped ones for the backward, or None)."""
        scores = paddle.matmul(q_block, k_block, transpose_y=True).astype(FP32)
        capped = None
        if self.softcap is not None:
            capped = paddle.tanh(scores / self.softcap)
            scores = capped * self.softcap
        if self.alibi is not None:
            scores = scores + _alibi(i0 - j0, i1 - i0, j1 - j0, self.groups, self.alibi)
        if self._masked(i0, i1, j0, j1):
            scores = scores + _mask(i0 - j0, i1 - i0, j1 - j0, self.groups, self.causal, self.window)
        if self.documents is not None and self.documents.cuts(i0, i1, j0):
            scores = scores + self.documents.mask(i0, i1, j0, j1, self.groups)
        return scores, capped


def _joined(blocks: list[paddle.Tensor]) -> paddle.Tensor:
    """Blocks along the rows, without a copy when there is one."""
    return blocks[0] if len(blocks) == 1 else paddle.concat(blocks, axis=2)


def attend(q_rows: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, groups: int, causal: bool,
           block: int = DEFAULT_BLOCK, out_dtype: str | None = None, spec: CoreSpec = PLAIN,
           documents: Documents | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(output rows in `out_dtype` (default q's), fp32 log-sum-exp [batch, kv_heads, rows, 1]) of
    already scaled query rows against k and v. `causal`: queries and keys are the same positions and
    a query sees keys up to its own (within `spec.window`, and inside its document when `documents`
    are given); otherwise every key."""
    blocks = Blocks(q_rows.shape[2] // groups, k.shape[2], groups, causal, block, spec, documents)
    # A causal call's rows each see their own position; a ring call's rows on another rank's keys may
    # see none of them inside their documents: such a row's output is 0 and its log-sum-exp -inf,
    # which the ring's merge weighs at 0 (its maximum is then taken as 0 to keep exp finite)
    unseen_rows = documents is not None and not causal
    outputs, sums = [], []
    for i0, i1 in blocks.queries():
        q_block = q_rows[:, :, i0 * groups:i1 * groups]
        keys = blocks.keys_for(i0, i1)
        if not keys:
            rows = [q_rows.shape[0], q_rows.shape[1], (i1 - i0) * groups]
            outputs.append(paddle.zeros(rows + [v.shape[3]], out_dtype or q_rows.dtype))
            sums.append(paddle.full(rows + [1], -np.inf, FP32))
            continue
        high = acc = total = None
        # the diagonal block first: every row sees its own position there, so its running maximum is
        # finite from the start and a later block the window hides from a row adds exp(-inf) = 0
        for j0, j1 in reversed(keys):
            scores, _ = blocks.scores(q_block, k[:, :, j0:j1], i0, i1, j0, j1)
            block_high = scores.max(-1, keepdim=True)
            new_high = block_high if high is None else paddle.maximum(high, block_high)
            finite_high = _finite(new_high) if unseen_rows else new_high
            probs = exp_normal(scores - finite_high)
            values = paddle.matmul(probs.astype(v.dtype), v[:, :, j0:j1]).astype(FP32)
            if high is None:
                total, acc = probs.sum(-1, keepdim=True), values
            else:
                rescale = exp_normal(high - finite_high)
                total, acc = total * rescale + probs.sum(-1, keepdim=True), acc * rescale + values
            high = new_high
        if unseen_rows:
            acc, high = acc / paddle.where(total > 0, total, paddle.ones_like(total)), _finite(high)
        else:
            acc = acc / total
        outputs.append(acc.astype(out_dtype or q_rows.dtype))
        sums.append(high + paddle.log(total))
    return _joined(outputs), _joined(sums)


def _finite(high: paddle.Tensor) -> paddle.Tensor:
    """Running row maxima with -inf (a row that has seen no key yet) taken as 0."""
    return paddle.where(paddle.isinf(high), paddle.zeros_like(high), high)


def attend_backward(q_rows, k, v, out_rows, lse, dout_rows, groups: int, causal: bool, block: int = DEFAULT_BLOCK,
                    spec: CoreSpec = PLAIN,
                    documents: Documents | None = None) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Gradients (of the scaled query rows, k, v) of `attend`, each block's probabilities recomputed
    from the log-sum-exp: FlashAttention-2's backward, key blocks outside, query blocks inside, over
    the pairs the forward met (key blocks are aligned with query blocks, so each is met whole)."""
    blocks = Blocks(q_rows.shape[2] // groups, k.shape[2], groups, causal, block, spec, documents)
    delta = (dout_rows.astype(FP32) * out_rows.astype(FP32)).sum(-1, keepdim=True)
    query_blocks = blocks.queries()
    met = [set(blocks.keys_for(i0, i1)) for i0, i1 in query_blocks]
    dq = [None] * len(query_blocks)
    dk, dv = [], []
    for j0, j1 in [(j, min(j + block, blocks.seq_k)) for j in range(0, blocks.seq_k, block)]:
        k_block, v_block = k[:, :, j0:j1], v[:, :, j0:j1]
        dk_block = dv_block = None
        for n, (i0, i1) in enumerate(query_blocks):
            if (j0, j1) not in met[n]:
                continue
            rows = slice(i0 * groups, i1 * groups)
            q_block, dout_block = q_rows[:, :, rows], dout_rows[:, :, rows]
            scores, capped = blocks.scores(q_block, k_block, i0, i1, j0, j1)
            probs = exp_normal(scores - lse[:, :, rows])
            dv_part = paddle.matmul(probs.astype(v.dtype), dout_block, transpose_x=True).astype(FP32)
            dprobs = paddle.matmul(dout_block, v_block, transpose_y=True).astype(FP32)
            dscores = probs * (dprobs - delta[:, :, rows])
            if capped is not None:
                dscores = dscores * (1.0 - paddle.square(capped))
            dscores = flush_subnormals_(dscores).astype(q_rows.dtype)
            dq_part = paddle.matmul(dscores, k_block).astype(FP32)
            dk_part = paddle.matmul(dscores, q_block, transpose_x=True).astype(FP32)
            dq[n] = dq_part if dq[n] is None else dq[n] + dq_part
            dk_block = dk_part if dk_block is None else dk_block + dk_part
            dv_block = dv_part if dv_block is None else dv_block + dv_part
        if dk_block is None:  # (a ring call with documents) a key block every query's document begins after
            dk_block, dv_block = paddle.zeros(k_block.shape, FP32), paddle.zeros(v_block.shape, FP32)
        dk.append(dk_block)
        dv.append(dv_block)
    for n, (i0, i1) in enumerate(query_blocks):
        if dq[n] is None:  # (the same) a query block that saw none of the keys
            dq[n] = paddle.zeros(q_rows.shape[:2] + [(i1 - i0) * groups, q_rows.shape[3]], FP32)
    return _joined(dq).astype(q_rows.dtype), _joined(dk).astype(k.dtype), _joined(dv).astype(v.dtype)


def with_sinks(out_rows: paddle.Tensor, lse: paddle.Tensor, sinks: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(output, log-sum-exp) once each row's softmax also counts its head's sink logit (`sink_rows`
    layout): L = logaddexp(lse, sink), the output scaled by exp(lse - L)."""
    total = paddle.maximum(lse, sinks) + paddle.log1p(exp_normal(-paddle.abs(lse - sinks)))
    return (out_rows.astype(FP32) * exp_normal(lse - total)).astype(out_rows.dtype), total


def sink_grad(out_rows, lse, dout_rows, sinks: paddle.Tensor, kv_heads: int) -> paddle.Tensor:
    """The gradient of the per-head sink logits [heads]: -sum over a head's rows of
    exp(sink - L) x rowsum(dO * O), with L the log-sum-exp that counts the sink."""
    delta = (dout_rows.astype(FP32) * out_rows.astype(FP32)).sum(-1, keepdim=True)
    column = sink_rows(sinks, kv_heads, lse.shape[2] * kv_heads // sinks.shape[0])
    per_row = flush_subnormals_(-(exp_normal(column - lse) * delta))  # [batch, kv_heads, seq x groups, 1]
    batch, groups = per_row.shape[0], sinks.shape[0] // kv_heads
    return per_row.reshape([batch, kv_heads, -1, groups]).sum(axis=[0, 2]).reshape([-1]).astype(sinks.dtype)


def _rows_of(t: paddle.Tensor, head_dim: int, kv_heads: int, seq_first: bool) -> paddle.Tensor:
    """An output-shaped tensor ([.., heads x head_dim]) as rows."""
    return to_rows(t.reshape(t.shape[:2] + [-1, head_dim]), kv_heads, seq_first)


class _BlockwiseAttention(PyLayer):
    """Causal attention of q [.., heads, qk_dim] on k [.., kv_heads, qk_dim] and v [.., kv_heads,
    v_dim] under `spec`, with per-head `sinks` (or an empty tensor: none). Keeps q, k, v as given,
    the output it returns (the output projection keeps the same tensor) and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seq_first: bool, block: int, spec: CoreSpec, documents: Documents | None):
        kv_heads = k.shape[2]
        groups, scale = q.shape[2] // kv_heads, spec.softmax_scale(q.shape[3])
        with full_precision():
            out_rows, lse = attend(to_rows(q, kv_heads, seq_first) * scale, to_heads(k, seq_first),
                                   to_heads(v, seq_first), groups, True, block, spec=spec, documents=documents)
            if sinks.shape[0]:
                out_rows, lse = with_sinks(out_rows, lse, sink_rows(sinks, kv_heads, q.shape[0 if seq_first else 1]))
            out = from_rows(out_rows, groups, seq_first)
        ctx.save_for_backward(*kept(q, k, v, out, lse, sinks))
        ctx.layout = (seq_first, block, groups, scale, spec, documents)
        ctx.sinks_learn = not sinks.stop_gradient  # Paddle wants None back for an input without gradient
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensor()
        seq_first, block, groups, scale, spec, documents = ctx.layout
        kv_heads, v_dim = k.shape[2], v.shape[3]
        with full_precision():
            out_rows, dout_rows = _rows_of(out, v_dim, kv_heads, seq_first), _rows_of(dout, v_dim, kv_heads, seq_first)
            dq_rows, dk, dv = attend_backward(to_rows(q, kv_heads, seq_first) * scale, to_heads(k, seq_first),
                                              to_heads(v, seq_first), out_rows, lse, dout_rows, groups, True, block,
                                              spec=spec, documents=documents)
            dq = from_rows(dq_rows * scale, groups, seq_first).reshape(q.shape)
            back = [2, 0, 1, 3] if seq_first else [0, 2, 1, 3]
            dsinks = sink_grad(out_rows, lse, dout_rows, sinks, kv_heads) if ctx.sinks_learn else None
            return dq, dk.transpose(back), dv.transpose(back), dsinks


NO_SINKS_SHAPE = [0]


def blockwise_causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool = False,
                               block: int = DEFAULT_BLOCK, spec: CoreSpec = PLAIN,
                               sinks: paddle.Tensor | None = None, documents: Documents | None = None) -> paddle.Tensor:
    """q [batch, seq, heads, qk_dim], k [batch, seq, kv_heads, qk_dim] and v [.., kv_heads, v_dim]
    (or all sequence first) -> [batch, seq, heads x v_dim] (or sequence first), under `spec`, with
    per-head sink logits `sinks` [heads] when given, each query inside its document when
    `documents` are given."""
    if sinks is None:
        sinks = paddle.zeros(NO_SINKS_SHAPE, "float32")
    return _BlockwiseAttention.apply(q, k, v, sinks, seq_first, block, spec, documents)


class RingKernel:
    """The blockwise core's computation of one block of ring attention (`attention_core/ring.py`):
    queries as rows [batch, kv_heads, seq x groups, qk_dim] (scaled before the kernel), k and v as
    [batch, kv_heads, seq, head_dim]; positions on axis 2 of both, the log-sum-exp [batch, kv_heads,
    rows, 1]. Honours the spec's scale and soft-cap (windows and ALiBi need positions the ring's
    blocks do not carry: context parallelism refuses them), sinks, and documents (each call's
    `Documents` carry its keys' positions)."""

    axis = 2

    def __init__(self, q_shape, kv_heads: int, v_dim: int, seq_first: bool, block: int, spec: CoreSpec):
        self.heads, self.qk_dim, self.v_dim = q_shape[2], q_shape[3], v_dim
        self.kv_heads, self.seq_first, self.block, self.spec = kv_heads, seq_first, block, spec
        self.groups, self.scale = self.heads // kv_heads, spec.softmax_scale(self.qk_dim)

    def queries(self, t, scaled: bool = False):
        """q ([.., heads, qk_dim]) as rows, scaled when asked."""
        rows = to_rows(t.reshape(t.shape[:2] + [self.heads, self.qk_dim]), self.kv_heads, self.seq_first)
        return rows * self.scale if scaled else rows

    def outputs(self, t):
        """An output or its gradient ([.., heads x v_dim]) as rows."""
        return _rows_of(t, self.v_dim, self.kv_heads, self.seq_first)

    def keys(self, t):
        return to_heads(t, self.seq_first)

    def attend(self, q, k, v, causal: bool, documents: Documents | None = None):
        return attend(q, k, v, self.groups, causal, self.block, out_dtype=FP32, spec=self.spec, documents=documents)

    def attend_backward(self, q, k, v, out, lse, dout, causal: bool, documents: Documents | None = None):
        grads = attend_backward(q, k, v, out, lse, dout, self.groups, causal, self.block, spec=self.spec,
                                documents=documents)
        return [grad.astype(FP32) for grad in grads]

    def with_sinks(self, out, lse, sinks):
        return with_sinks(out, lse, sink_rows(sinks, self.kv_heads, lse.shape[2] // self.groups))

    def sink_grad(self, out, lse, dout, sinks):
        return sink_grad(out, lse, dout, sinks, self.kv_heads)

    def output(self, out, dtype):
        return from_rows(out.astype(dtype), self.groups, self.seq_first)

    def query_grad(self, dq, like):
        return from_rows((dq * self.scale).astype(like.dtype), self.groups, self.seq_first).reshape(like.shape)

    def key_grad(self, grad, like):
        return grad.astype(like.dtype).transpose([2, 0, 1, 3] if self.seq_first else [0, 2, 1, 3])
