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
  carried from chunk to chunk. O(T C d + T d^2) work per head.
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

import paddle

from paddle_pp.runtime.normal_range import flush_subnormals


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


def chunked(q, k, v, g, beta=None, initial_state=None, segments=None, chunk_size: int = 64):
    """`recurrent_reference` by chunks of `chunk_size` tokens (the length padded up to a multiple:
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


def part_summary(k, v, g, beta=None, segments=None, chunk_size: int = 64):
    """What a part of a sequence does to the state, as (T, L): the state after the part is affine in
    the state before it, S_after = T S_before + L, with T [B, H, d_k, d_k] the product of each token's
    (I - beta_t k_t k_t^T) a_t over the part (a_t alone without the delta term) and L [B, H, d_k, d_v]
    the part run from a zero state. Context parallelism exchanges these instead of
    keys and values: each rank folds the summaries of the parts before its own (`fold_states`) and
    runs its part from that state. The map S -> T S is the part run on S with zero values, so T is that
    run from the identity (whose columns stand for d_k values)."""
    batch, length, heads, d_k = k.shape[0], k.shape[1], v.shape[2], k.shape[3]
    queries = paddle.zeros([batch, length, k.shape[2], d_k], "float32")  # outputs are not needed
    identity = paddle.eye(d_k, dtype="float32").expand([batch, heads, d_k, d_k])
    _, transition = chunked(queries, k, paddle.zeros([batch, length, heads, d_k], "float32"), g, beta,
                            initial_state=identity, segments=segments, chunk_size=chunk_size)
    _, local = chunked(queries, k, v, g, beta, segments=segments, chunk_size=chunk_size)
    return transition, local


def fold_states(summaries: list, starts_document: list[bool] | None = None, initial_state=None) -> list:
    """The state before each part (None: zero), in sequence order, from the parts' (T, L) summaries
    (`part_summary`) and the state before the first; a part whose first token starts a document
    (`starts_document`) begins from zero, as its run cannot tell (a part's first token continues
    whatever state it is given)."""
    state, before = initial_state, []
    for index, (transition, local) in enumerate(summaries):
        if starts_document is not None and starts_document[index]:
            state = None
        before.append(state)
        state = local if state is None else transition @ state + local
    return before
