"""Ring attention: the attention of a context-parallel run (`modeling/context_parallel.py` cuts each
sequence over the cp ranks), k and v passed around the ring of cp ranks, each block computed by the
inner core the run would take without cp (`RingCore.inner`: flash on GPU where it applies, blockwise
elsewhere), through that core's `ring_kernel`.

Ring step i (1 <= i < cp) brings rank r the k and v of rank s = r - i (mod cp): if s < r its first
chunk precedes both of r's chunks and its second follows them, so every local query attends the
first half of what arrived, fully; if s > r only r's second chunk follows both arrived chunks and
attends all of it, fully. Each step is the same work (PaddleNLP's `second_chunk_only`), and the
next block travels while this one computes. Partial outputs merge by their log-sum-exp in fp32;
sinks are counted once, after the merge. Backward runs the ring again with a second stream one step
behind: the gradients of each block's k and v, each rank adding its part before passing them on,
and one last shift returns them home.

A layer's scale, soft-cap and sinks hold around the ring, and so do documents (per-document
attention): each call's kernel is told the sequence positions of the keys it sees (`_RingDocuments`),
masks the keys outside each query's document, and skips the blocks wholly before every query's
document; a call's row that sees none of the arriving keys adds nothing to the merge. The blockwise
kernel computes them (flash's has no per-call document mask: a per-document ring runs blockwise).
A sliding window is the same kind of bound (query p sees keys from p - W + 1, `_windowed`): each
call's keys are masked by their sequence positions, so a window shorter than a rank's part reaches
into the parts before it exactly as on one card, and blocks wholly before every query's window are
skipped. ALiBi needs distances across blocks the ring does not give its kernels: such a model under
context parallelism is refused by name before any process group (`context_parallel_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.attention_core import CORES, AttentionCore, BlockwiseCore, Heads
from modeling.attention_core.blockwise import NO_SINKS_SHAPE
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.autocast import full_precision
from modeling.context_parallel import local_positions
from modeling.documents import Documents
from modeling.saved_tensors import kept
from paddle_pp.runtime.normal_range import exp_normal

FP32_BYTES = 4


class Ring(Protocol):
    """The cp ranks' ring, as the runtime builds it: this rank's place and one shift along it."""

    degree: int
    rank: int

    def start_shift(self, tensors: list[paddle.Tensor], stream: str = "kv") -> Callable[[], list[paddle.Tensor]]:
        """Start sending `tensors` to the next rank of the ring; the returned call waits and gives the
        same-shaped ones from the previous rank. One shift per stream ("kv", "grad") at a time."""
        ...

    def all_reduce(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The sum of `tensor` over the cp ranks (no gradient)."""
        ...


def _part(t, axis: int, start: int, stop: int | None = None):
    return paddle.slice(t, [axis], [start], [t.shape[axis] if stop is None else stop])


def _merge(out, lse, part_out, part_lse):
    """Two partial attentions of the same queries (fp32 outputs, their log-sum-exps) merged into one."""
    new_lse = paddle.maximum(lse, part_lse) + paddle.log1p(exp_normal(-paddle.abs(lse - part_lse)))
    return out * exp_normal(lse - new_lse) + part_out * exp_normal(part_lse - new_lse), new_lse


def _merge_second_half(out, lse, part_out, part_lse, axis: int):
    half = out.shape[axis] // 2
    merged = _merge(_part(out, axis, half), _part(lse, axis, half), part_out, part_lse)
    return [paddle.concat([_part(whole, axis, 0, half), new], axis=axis) for whole, new in zip((out, lse), merged)]


def _source(ring: Ring, step: int) -> int:
    """The rank whose k and v arrive at ring step `step`."""
    return (ring.rank - step) % ring.degree


def _sees_all_of_first_chunk(ring: Ring, source: int) -> bool:
    """Whether the k and v of `source` came from an earlier rank (its first chunk precedes both of
    ours: every local query sees that chunk) rather than a later one (only our second chunk sees
    them, both chunks)."""
    return source < ring.rank


@dataclass(frozen=True)
class _RingDocuments:
    """Per-document attention around the ring: this rank's queries' document starts (sequence
    positions), and each call's `Documents` with the positions of the keys it sees."""

    documents: Documents | None
    ring: Ring

    def call(self, source: int, local_len: int, first_chunk_only: bool = False, second_half_queries: bool = False):
        """The documents of this rank's queries (all, or the second half) on the keys of rank
        `source` (both its chunks, or its first): None when the run is not per document."""
        if self.documents is None:
            return None
        keys = local_positions(local_len * self.ring.degree, self.ring.degree, source)
        keys = keys[:local_len // 2] if first_chunk_only else keys
        return self.documents.for_keys(keys, slice(local_len // 2, None) if second_half_queries else slice(None))


class _RingAttention(PyLayer):
    """Causal attention of this rank's queries on the whole sequence's keys and values, the latter
    passed around the ring; keeps q, k, v as given, the output and the log-sum-exp (as the blockwise
    core does: the output projection keeps the same output tensor), and the sinks (an empty tensor
    when the layer has none)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: Ring, kernel, documents: Documents | None):
        axis = kernel.axis
        docs = _RingDocuments(documents, ring)
        with full_precision():
            q_local, kv = kernel.queries(q, scaled=True), [kernel.keys(k), kernel.keys(v)]
            local_len = kv[0].shape[axis]
            arriving = ring.start_shift(kv) if ring.degree > 1 else None
            out, lse = kernel.attend(q_local, *kv, True, docs.call(ring.rank, local_len))
            for step in range(1, ring.degree):
                kv = arriving()
                if step + 1 < ring.degree:  # the next block travels while this one computes
                    arriving = ring.start_shift(kv)
                source = _source(ring, step)
                if _sees_all_of_first_chunk(ring, source):
                    first = [_part(t, axis, 0, t.shape[axis] // 2) for t in kv]
                    part = kernel.attend(q_local, *first, False, docs.call(source, local_len, first_chunk_only=True))
                    out, lse = _merge(out, lse, *part)
                else:
                    second = _part(q_local, axis, q_local.shape[axis] // 2)
                    part = kernel.attend(second, *kv, False, docs.call(source, local_len, second_half_queries=True))
                    out, lse = _merge_second_half(out, lse, *part, axis)
            if sinks.shape[0]:
                out, lse = kernel.with_sinks(out, lse, sinks)
            result = kernel.output(out, q.dtype)
        ctx.save_for_backward(*kept(q, k, v, result, lse, sinks))
        ctx.setting = (ring, kernel, docs)
        ctx.sinks_learn = not sinks.stop_gradient  # Paddle wants None back for an input without gradient
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensor()
        ring, kernel, docs = ctx.setting
        axis = kernel.axis
        with full_precision():
            q_local, out_local, dout_local = kernel.queries(q, scaled=True), kernel.outputs(out), kernel.outputs(dout)
            dsinks = kernel.sink_grad(out_local, lse, dout_local, sinks) if ctx.sinks_learn else None
            kv = [kernel.keys(k), kernel.keys(v)]
            local_len = kv[0].shape[axis]
            own = docs.call(ring.rank, local_len)
            if ring.degree == 1:
                dq, dk, dv = kernel.attend_backward(q_local, *kv, out_local, lse, dout_local, True, own)
                return kernel.query_grad(dq, q), kernel.key_grad(dk, k), kernel.key_grad(dv, v), dsinks
            arriving = ring.start_shift(kv)
            dq, dk, dv = kernel.attend_backward(q_local, *kv, out_local, lse, dout_local, True, own)
            grads_arriving = ring.start_shift([dk, dv], "grad")
            half = q_local.shape[axis] // 2
            second = [_part(t, axis, half) for t in (q_local, out_local, lse, dout_local)]
            for step in range(1, ring.degree):
                keys, values = arriving()
                if step + 1 < ring.degree:
                    arriving = ring.start_shift([keys, values])
                source = _source(ring, step)
                if _sees_all_of_first_chunk(ring, source):
                    first = keys.shape[axis] // 2
                    part = kernel.attend_backward(q_local, _part(keys, axis, 0, first), _part(values, axis, 0, first),
                                                  out_local, lse, dout_local, False,
                                                  docs.call(source, local_len, first_chunk_only=True))
                    dq = dq + part[0]
                    key_grads, value_grads = grads_arriving()  # this block's gradients from the ranks before
                    key_grads, value_grads = (
                        paddle.concat([_part(grads, axis, 0, first) + new, _part(grads, axis, first)], axis=axis)
                        for grads, new in ((key_grads, part[1]), (value_grads, part[2])))
                else:
                    query, output, partial_lse, output_grad = second
                    part = kernel.attend_backward(query, keys, values, output, partial_lse, output_grad, False,
                                                  docs.call(source, local_len, second_half_queries=True))
                    dq = paddle.concat([_part(dq, axis, 0, half), _part(dq, axis, half) + part[0]], axis=axis)
                    key_grads, value_grads = grads_arriving()
                    key_grads, value_grads = key_grads + part[1], value_grads + part[2]
                grads_arriving = ring.start_shift([key_grads, value_grads], "grad")
            dk, dv = grads_arriving()  # home: every rank's gradients of this rank's k and v
            return kernel.query_grad(dq, q), kernel.key_grad(dk, k), kernel.key_grad(dv, v), dsinks


def ring_attention(q, k, v, ring: Ring, seq_first: bool = False, inner: AttentionCore = CORES["blockwise"],
                   spec: CoreSpec = PLAIN, sinks: paddle.Tensor | None = None, documents: Documents | None = None):
    """As the inner core's attention for this rank's tokens of a sequence cut over `ring`, each block
    computed by `inner`'s ring kernel (blockwise; or flash: Paddle's kernel on GPU), inside each
    query's document when `documents` (the starts of this rank's queries) are given."""
    if spec.window is not None:  # a window is a lower bound per query, in sequence positions, as a document is
        documents = _windowed(documents, spec.window, ring, q.shape[0 if seq_first else 1])
        spec = replace(spec, window=None)
    if documents is not None and not isinstance(inner, BlockwiseCore):
        inner = CORES["blockwise"]  # the only kernel taking each call's documents
    kernel = inner.ring_kernel(q.shape, k.shape[2], v.shape[3], seq_first, spec)
    return _RingAttention.apply(q, k, v, paddle.zeros(NO_SINKS_SHAPE, "float32") if sinks is None else sinks, ring,
                                kernel, documents)


def context_parallel_refusal(spec: CoreSpec) -> str | None:
    """What of a layer's attention ring attention does not compute, or None."""
    if spec.alibi is not None:
        return "ALiBi position biases"
    return None


def _windowed(documents: Documents | None, window: int, ring: Ring, local_len: int) -> Documents:
    """This rank's queries' first visible keys under a sliding window of `window` keys (query p sees
    keys from p - window + 1), inside their documents when there are any: the blockwise kernel masks
    each call's keys by their sequence positions against these and skips the blocks before them, so
    a window shorter than a rank's part reaches into the parts before it, as on one card."""
    held = local_positions(local_len * ring.degree, ring.degree, ring.rank)
    starts = np.maximum(held - window + 1, 0)[None, :]
    return Documents(starts if documents is None else np.maximum(documents.starts, starts))


@dataclass(frozen=True)
class RingCore(AttentionCore):
    """The attention core of a context-parallel run: the ring around the `inner` core the run would
    take without cp. A rank keeps q, k, v, the merged output and its fp32 log-sum-exp for its own
    tokens, whichever the kernel (the blockwise core's model); the other ranks' k and v pass through."""

    name = "ring"
    ring: Any = None
    inner: AttentionCore = field(default_factory=lambda: CORES["blockwise"])

    def __call__(self, q, k, v, seq_first, spec=PLAIN, sinks=None, documents=None):
        return ring_attention(q, k, v, self.ring, seq_first, self.inner, spec, sinks, documents)

    def refusal(self, spec: CoreSpec, sinks: bool, heads: Heads) -> str | None:
        return self.inner.refusal(spec, sinks, heads)

    def serving(self, spec: CoreSpec, sinks: bool, heads: Heads) -> AttentionCore:
        return self if self.refusal(spec, sinks, heads) is None else RingCore(self.ring, CORES["blockwise"])

    def saved_bytes(self, batch, seq_len, heads, dtype_bytes, seq_first, spec=PLAIN, sinks=False) -> int:
        return CORES["blockwise"].saved_bytes(batch, seq_len, heads, dtype_bytes, seq_first, spec, sinks)

    def keeps_output(self, seq_first: bool) -> bool:
        return True


def ring_traffic_bytes(batch: int, local_len: int, kv_heads: int, head_dim: int, degree: int,
                       dtype_bytes: int, forward_passes: int = 1) -> int:
    """Bytes one rank sends around the ring for one attention call, forward (once, or again when it
    is recomputed) and backward: k and v cp - 1 times per forward; k, v and their fp32 gradients
    cp - 1 times and the gradients home once in backward."""
    if degree == 1:
        return 0
    kv = 2 * batch * local_len * kv_heads * head_dim  # k and v elements
    return (degree - 1) * kv * dtype_bytes * (forward_passes + 1) + (degree - 1) * kv * FP32_BYTES + kv * FP32_BYTES
