"""The recurrent core of the hybrid families' linear token mixers: per value head a d_k x d_v state
S carried along the sequence, read by each query.

    S_t = a_t S_{t-1} + beta_t k_t (v_t - (a_t S_{t-1})^T k_t)^T     the gated delta rule (Gated DeltaNet)
    S_t = a_t S_{t-1} + k_t v_t^T                                      without the delta term (Mamba-2's SSD)
    o_t = S_t^T q_t

with a_t = exp(g_t), g_t <= 0 one number per head and token (Gated DeltaNet, Mamba-2) or one per key
channel, a_t = diag(exp(g_t)) (Kimi Delta Attention). The caller prepares q, k, v, g and beta (the
projections, the conv, the normalisations and the query scale are the mixer's): here is only the
rule, in two forms:
- `recurrent_reference`, token by token: the definition, and the tests' oracle;
- `chunked`, the training form: inside a chunk of C tokens the delta rule's C updates are one
  unit-lower-triangular solve (the WY form: DeltaNet's UT transform) and matmuls, the state is
  carried from chunk to chunk. O(T C d + T d^2) work per head. It runs by spans of chunks and keeps
  for the backward only each span's starting state, running the span again there: its memory beyond
  inputs and outputs does not grow with the length.
Packed documents: `segments` (one integer per token, equal within a document) restarts the state at
every document, as if each were run alone; in the chunked form by masking the decays between
tokens of different documents to 0 (the conv window's restart is the mixer's).
Parts of a sequence (context parallelism's) need no keys and values of the others: a part's effect
on the state is affine, S_after = T S_before + L (`part_summary`), so the states before each part
follow from the parts' summaries alone (`fold_states`), and each part runs from its own.
In the chunked form every decay that leaves the fp32 normal range is made exactly 0 (`normal_range`):
on Intel CPUs a product over subnormals costs ~100x.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from modeling.blocks.norms import FP32_BYTES
from paddle_pp.runtime.normal_range import flush_subnormals

INDEX_BYTES = 8  # the int64 document ids


@dataclass(frozen=True)
class RecurrentCore:
    """How a run computes the recurrent rule, chosen once (`Execution.recurrent`) like its attention
    core: chunks of `chunk_size` tokens, `span_chunks` chunks per span recomputed in the backward
    (`chunked`). Tests take chunks shorter than their sequences, so the carry between chunks and
    spans is exercised."""

    chunk_size: int = 64
    span_chunks: int = 16

    def __call__(self, q, k, v, g, beta=None, initial_state=None, segments=None):
        return chunked(q, k, v, g, beta, initial_state, segments, self.chunk_size, self.span_chunks)

    def summary(self, k, v, g, beta=None, segments=None):
        """A part's (T, L) (`part_summary`)."""
        return part_summary(k, v, g, beta, segments, self.chunk_size, self.span_chunks)

    def kept_bytes(self, batch: int, seq_len: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                   dtype_bytes: int, decay_width: int = 1, with_beta: bool = True) -> int:
        """What a training call keeps for backward (`_SpanRecompute`): its inputs q and k (per key
        head), v, the decays g (fp32, `decay_width` per value head: 1, or key_dim for a decay per key
        channel) and beta (the delta rule's), the document ids (int64), and the state before each span
        (fp32; the first a zero state)."""
        tokens, spans = batch * seq_len, -(-seq_len // (self.chunk_size * self.span_chunks))
        inputs = tokens * (2 * key_heads * key_dim + value_heads * value_dim + value_heads * with_beta) * dtype_bytes
        states = spans * batch * value_heads * key_dim * value_dim * FP32_BYTES
        return inputs + tokens * value_heads * decay_width * FP32_BYTES + tokens * INDEX_BYTES + states


def recurrent_reference(q, k, v, g, beta=None, initial_state=None, segments=None):
    """o [B, T, H, d_v] and the final state [B, H, d_k, d_v] of the rule, one token at a time.

    q, k: [B, T, H_k, d_k] (H_k dividing H: each key head serves H / H_k consecutive value heads);
    v: [B, T, H, d_v]; g: [B, T, H] (scalar decay) or [B, T, H, d_k] (per key channel); beta: [B, T, H]
    for the delta rule, None without it; segments: [B, T] document ids."""
    q, k = value_heads(q, k, v.shape[2])
    batch, length, heads, d_k = k.shape
    state = (paddle.zeros([batch, heads, d_k, v.shape[-1]], "float32") if initial_state is None
             else initial_state.astype("float32"))
    outputs = []
    for t in range(length):
        decay = paddle.exp(g[:, t].astype("float32"))
        decay = decay[..., None, None] if decay.ndim == 2 else decay[..., None]
        if segments is not None and t > 0:
            same = (segments[:, t] == segments[:, t - 1]).astype("float32")[:, None, None, None]
            decay = decay * same
        state = state * decay
        k_t, v_t, q_t = (x[:, t].astype("float32") for x in (k, v, q))
        if beta is None:
            state = state + k_t[..., None] * v_t[..., None, :]
        else:
            error = v_t - (state * k_t[..., None]).sum(-2)
            state = state + k_t[..., None] * (beta[:, t].astype("float32")[..., None] * error)[..., None, :]
        outputs.append((state * q_t[..., None]).sum(-2))
    return paddle.stack(outputs, axis=1), state


def value_heads(q, k, heads: int):
    """q and k per value head: each of the key heads serves `heads` / their number consecutive value
    heads (Qwen3.5: 16 key heads, 32 value heads)."""
    groups = heads // k.shape[2]
    if groups == 1:
        return q, k
    return paddle.repeat_interleave(q, groups, axis=2), paddle.repeat_interleave(k, groups, axis=2)


def _decay(log_decay):
    """exp of a log decay, what falls under the fp32 normal range exactly 0 (autograd-safe)."""
    return flush_subnormals(paddle.exp(log_decay))


def _chunks(x, size: int):
    """[B, H, T(, d)] -> [B, H, T / size, size(, d)]."""
    return x.reshape([x.shape[0], x.shape[1], -1, size, *x.shape[3:]])


def chunked(q, k, v, g, beta=None, initial_state=None, segments=None, chunk_size: int = 64, span_chunks: int = 16):
    """`recurrent_reference` by chunks of `chunk_size` tokens, `span_chunks` chunks at a time: its
    memory beyond its inputs and outputs is one span's, whatever the length. Each span's chunk
    products, solves and decays ([C, C] per chunk and head) are what autograd would keep for the
    backward: it keeps the state at each span's start instead and runs each span again in the
    backward, last first (`_SpanRecompute`), for 1.1-1.3x the time of keeping them (and a third of
    the peak at 64k tokens: bench/recurrent_core.py). A short sequence is one span, run the same
    way: what a training forward keeps is its inputs and a state per span, whatever the length (the
    planner's model: `RecurrentCore.kept_bytes`)."""
    if segments is None:
        segments = paddle.zeros(k.shape[:2], "int64")
    span = chunk_size * span_chunks
    tensors = [q, k, v, g] + ([] if beta is None else [beta]) + ([] if initial_state is None else [initial_state])
    if not paddle.is_grad_enabled() or all(tensor.stop_gradient for tensor in tensors):
        with paddle.no_grad():
            return _spans_forward(tensors, beta is not None, segments, chunk_size, span)[:2]
    return _SpanRecompute.apply(segments, beta is not None, chunk_size, span, *tensors)


def _split(tensors: list, with_beta: bool):
    """(q, k, v, g, beta, initial state or None) from the flat tensor list `chunked` hands the spans."""
    rest = tensors[4 + with_beta:]
    return (*tensors[:4], tensors[4] if with_beta else None, rest[0] if rest else None)


def _span_bounds(length: int, span: int) -> list[tuple[int, int]]:
    return [(start, min(start + span, length)) for start in range(0, length, span)]


def _run_span(pieces: list, with_beta: bool, state, segments, start: int, end: int, chunk_size: int):
    """Tokens [start, end) (`pieces`: q, k, v, g(, beta) cut to them) run from `state`, the state
    after token start - 1 (None: zero); a document starting at `start` starts from zero, as a run
    cannot see the token before its first."""
    if start > 0 and state is not None:
        same = (segments[:, start] == segments[:, start - 1]).astype("float32")
        state = state * same[:, None, None, None]
    q, k, v, g, beta, _ = _split(pieces, with_beta)
    return _chunked_span(q, k, v, g, beta, state, segments[:, start:end], chunk_size)


def _spans_forward(tensors: list, with_beta: bool, segments, chunk_size: int, span: int):
    """(output, final state, the state before each span), the spans run in order."""
    state = _split(tensors, with_beta)[-1]
    outputs, starts = [], []
    for start, end in _span_bounds(tensors[1].shape[1], span):
        starts.append(state)
        pieces = [tensor[:, start:end] for tensor in tensors[:4 + with_beta]]
        output, state = _run_span(pieces, with_beta, state, segments, start, end, chunk_size)
        outputs.append(output)
    return paddle.concat(outputs, axis=1), state, starts


class _SpanRecompute(paddle.autograd.PyLayer):
    """`chunked` over spans, keeping for the backward only its inputs and each span's starting state;
    the backward runs each span again with autograd, from the last, and hands the gradient of the
    span's starting state to the span before."""

    @staticmethod
    def forward(ctx, segments, with_beta: bool, chunk_size: int, span: int, *tensors):
        output, state, starts = _spans_forward(list(tensors), with_beta, segments, chunk_size, span)
        batch, heads, d_k, d_v = state.shape
        zero = paddle.zeros([batch, heads, d_k, d_v], "float32")
        ctx.save_for_backward(segments, *tensors, *(zero if start is None else start for start in starts))
        ctx.layout = (with_beta, chunk_size, span, len(tensors))
        ctx.needed = [not tensor.stop_gradient for tensor in tensors]  # Paddle wants None for the others
        return output, state

    @staticmethod
    def backward(ctx, d_output, d_state):
        with_beta, chunk_size, span, count = ctx.layout
        saved = ctx.saved_tensor()
        segments, tensors, starts = saved[0], saved[1:1 + count], saved[1 + count:]
        timed = 4 + with_beta  # the inputs with a time axis
        grads = [[] for _ in range(timed)]
        for (start, end), state in reversed(list(zip(_span_bounds(tensors[1].shape[1], span), starts))):
            leaves = [tensor[:, start:end].detach() for tensor in tensors[:timed]] + [state.detach()]
            for leaf in leaves:
                leaf.stop_gradient = False
            with paddle.enable_grad():
                output, after = _run_span(leaves[:-1], with_beta, leaves[-1], segments, start, end, chunk_size)
            d_state = paddle.zeros_like(after) if d_state is None else d_state
            found = paddle.grad([output, after], leaves, [d_output[:, start:end], d_state], allow_unused=True)
            for index, grad in enumerate(found[:-1]):
                grads[index].append(paddle.zeros_like(leaves[index]) if grad is None else grad)
            d_state = found[-1]
        gradients = [paddle.concat(pieces[::-1], axis=1) for pieces in grads] + ([d_state] if count > timed else [])
        return (None, *(grad if needed else None for grad, needed in zip(gradients, ctx.needed)))


def _chunked_span(q, k, v, g, beta, initial_state, segments, chunk_size: int):
    """The rule by chunks of `chunk_size` tokens, all at once (the length padded up to a multiple:
    padding decays nothing and writes nothing). With a decay per key channel the decay between two
    tokens of a chunk is a d_k vector: their products are taken channel by channel ([C, C, d_k] per
    chunk and head, so such runs take smaller chunks)."""
    q, k = value_heads(q, k, v.shape[2])
    batch, length, heads, d_k = k.shape
    per_channel = g.ndim == 4
    pad = -length % chunk_size
    q, k, v = (x.astype("float32").transpose([0, 2, 1, 3]) for x in (q, k, v))  # [B, H, T, d]
    g = g.astype("float32").transpose([0, 2, 1, 3] if per_channel else [0, 2, 1])
    beta = None if beta is None else beta.astype("float32").transpose([0, 2, 1])
    if segments is None:
        segments = paddle.zeros([batch, length], "int64")
    if pad:
        q, k, v = (_pad_time(x, pad) for x in (q, k, v))
        g = _pad_time(g, pad) if per_channel else _pad_last(g, pad)
        beta = None if beta is None else _pad_last(beta, pad)
        # padding continues the last document and writes nothing (its k and v are 0)
        segments = paddle.concat([segments, segments[:, -1:].expand([batch, pad])], axis=1)
    q, k, v = (_chunks(x, chunk_size) for x in (q, k, v))  # [B, H, N, C, d]
    cum = paddle.cumsum(_chunks(g, chunk_size), axis=3)  # [B, H, N, C(, d_k)]: log decay from the chunk's start
    segments = segments.reshape([batch, 1, -1, chunk_size]).astype("int64")  # [B, 1, N, C]
    channels = (lambda x: x.unsqueeze(-1)) if per_channel else (lambda x: x)  # a mask over tokens, over channels too
    lower = paddle.tril(paddle.ones([chunk_size, chunk_size], "bool"))
    visible = channels(paddle.logical_and(segments.unsqueeze(-1) == segments.unsqueeze(-2), lower))
    gap = cum.unsqueeze(4) - cum.unsqueeze(3)  # [B, H, N, C, C(, d_k)]: log decay from token j to token i
    pairwise = _decay(paddle.where(visible, gap, paddle.full_like(gap, float("-inf"))))
    # the state from before the chunk reaches only the tokens of the document it ends in, and leaves
    # the chunk only when that document spans it; a token's write reaches the chunk's end likewise
    carried = (segments == _previous_segment(segments)).astype("float32")  # [B, 1, N, C]
    in_last = (segments == segments[..., -1:]).astype("float32")
    # decays per token as [.., C, d_k] or [.., C, 1]: they scale rows of q and k
    read_old = _decay(cum) * channels(carried)
    to_end = _decay(cum[:, :, :, -1:] - cum) * channels(in_last)
    if not per_channel:
        read_old, to_end = read_old.unsqueeze(-1), to_end.unsqueeze(-1)
    keep_state = _decay(cum[:, :, :, -1]) * channels(carried[:, :, :, 0] * in_last[:, :, :, 0])
    keep_state = keep_state.unsqueeze(-1) if per_channel else keep_state[..., None, None]  # rows of the state
    attention = _decayed_products(q, k, pairwise, per_channel)
    if beta is not None:
        beta = beta.reshape([batch, heads, -1, chunk_size]).unsqueeze(-1)
        k_beta = k * beta
        system = paddle.tril(_decayed_products(k_beta, k, pairwise, per_channel), -1)
        unit = paddle.eye(chunk_size, dtype="float32") + system
        values = paddle.linalg.triangular_solve(unit, v * beta, upper=False, unitriangular=True)
        reads = paddle.linalg.triangular_solve(unit, k_beta * read_old, upper=False, unitriangular=True)
    else:
        values, reads = v, None
    state = (paddle.zeros([batch, heads, d_k, v.shape[-1]], "float32") if initial_state is None
             else initial_state.astype("float32"))
    # per chunk, split once: a slice per chunk would cost its backward a zero tensor of the whole (O(N^2))
    per_chunk = [paddle.unbind(x, axis=2) for x in (
        values, q * read_old, attention, (k * to_end).transpose([0, 1, 2, 4, 3]), keep_state)]
    reads = paddle.unbind(reads, axis=2) if reads is not None else None
    outputs = []
    for n, (value, query, within, writes, keep) in enumerate(zip(*per_chunk)):
        new = value if reads is None else value - reads[n] @ state
        outputs.append(query @ state + within @ new)
        state = state * keep + writes @ new
    out = paddle.stack(outputs, axis=2).reshape([batch, heads, -1, v.shape[-1]])[:, :, :length]
    return out.transpose([0, 2, 1, 3]), state


def _decayed_products(a, b, pairwise, per_channel: bool):
    """[.., C, C]: a_i . b_j decayed from token j to token i (by channel when the decay is)."""
    if per_channel:
        return (a.unsqueeze(4) * b.unsqueeze(3) * pairwise).sum(-1)
    return (a @ b.transpose([0, 1, 2, 4, 3])) * pairwise


def _pad_time(x, pad: int):
    """[B, H, T, d] padded with zeros to T + pad tokens."""
    return paddle.nn.functional.pad(x, [0, 0, 0, pad], data_format="NCHW")


def _pad_last(x, pad: int):
    """[B, H, T] padded with zeros to T + pad tokens."""
    return paddle.nn.functional.pad(x, [0, pad], data_format="NCL")


def _previous_segment(segments):
    """Per chunk, the document id of the token before the chunk (the first chunk's: its own first)."""
    last = segments[..., -1:]  # [B, 1, N, 1]
    return paddle.concat([segments[:, :, :1, :1], last[:, :, :-1]], axis=2)


def part_summary(k, v, g, beta=None, segments=None, chunk_size: int = 64, span_chunks: int = 16):
    """What a part of a sequence does to the state, as (T, L): the state after the part is affine in
    the state before it, S_after = T S_before + L, with T [B, H, d_k, d_k] the product of each token's
    (I - beta_t k_t k_t^T) a_t over the part (a_t alone without the delta term) and L [B, H, d_k, d_v]
    the part run from a zero state. Context parallelism exchanges these instead of keys and values
    (`recurrent_cp`). Each column of the state evolves alone, by its own value entries, so one run
    gives both: the values widened by d_k zero columns, from the state [0 | I] (whose last d_k
    columns stand for the map S -> T S); the queries are not needed."""
    batch, length, heads, d_k = k.shape[0], k.shape[1], v.shape[2], k.shape[3]
    d_v = v.shape[-1]
    widened = paddle.concat([v.astype("float32"), paddle.zeros([batch, length, heads, d_k], "float32")], axis=-1)
    start = paddle.concat([paddle.zeros([batch, heads, d_k, d_v], "float32"),
                           paddle.eye(d_k, dtype="float32").expand([batch, heads, d_k, d_k])], axis=-1)
    queries = paddle.zeros([batch, length, k.shape[2], d_k], "float32")
    _, final = chunked(queries, k, widened, g, beta, start, segments, chunk_size, span_chunks)
    return final[..., d_v:], final[..., :d_v]


def fold_states(summaries: list, starts_document: list | None = None, initial_state=None) -> list:
    """The state before each part (None: zero), in sequence order, from the parts' (T, L) summaries
    (`part_summary`) and the state before the first; where a part's first token starts a document
    (`starts_document`: per part a bool, or a [batch] bool tensor of each row's) the part begins from
    zero, as its run cannot tell (a part's first token continues whatever state it is given)."""
    state, before = initial_state, []
    for index, (transition, local) in enumerate(summaries):
        starts = False if starts_document is None else starts_document[index]
        if state is not None and starts is not False:
            state = None if starts is True else state * (~starts).astype(state.dtype)[:, None, None, None]
        before.append(state)
        state = local if state is None else transition @ state + local
    return before


def document_ids(positions):
    """[batch, seq] int64: which document of its row each token is in (a new one wherever a position is 0)."""
    ids = paddle.cumsum((positions == 0).astype("int64"), axis=1)
    ids.stop_gradient = True
    return ids
