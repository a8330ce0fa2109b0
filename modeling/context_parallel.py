"""Context parallelism: a sequence longer than one rank holds, cut over the cp ranks, with attention
computed by passing k and v around the ring of cp ranks (ring attention on the blockwise core).

The split balances causal work (PaddleNLP's, Megatron's and torchtitan's head-tail split): each
sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, in order, so the
positions it holds increase and attention on its own tokens is plain causal attention. Everything
else is position-wise and needs nothing but the positions themselves (`local_positions`: rotary
tables, learned positions). The loss is a sum over cp ranks of each rank's summed token losses
over the count of the whole sequence's counted labels (not a mean of means).

Ring step i (1 <= i < cp) brings rank r the k and v of rank s = r - i (mod cp): if s < r its first
chunk precedes both of r's chunks and its second follows them, so every local query attends the
first half of what arrived, fully; if s > r only r's second chunk follows both arrived chunks and
attends all of it, fully. Each step is the same work (PaddleNLP's `second_chunk_only`), and the
next block travels while this one computes. Partial outputs merge by their log-sum-exp in fp32.
Backward runs the ring again with a second stream one step behind: the gradients of each block's k
and v, each rank adding its part before passing them on, and one last shift returns them home.

Weights are whole on every cp rank: cp ranks are replicas of each other for the checkpoint and sum
their gradients (fleet's `sep` axis: all-reduced over dp x cp, averaged over dp only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import paddle
from paddle.autograd import PyLayer

from modeling.attention_core import AttentionCore, BlockwiseCore
from modeling.attention_core.blockwise import DEFAULT_BLOCK, attend, attend_backward, from_rows, to_heads, to_rows
from modeling.attention_core.flash import flash_block, flash_block_backward
from modeling.autocast import full_precision

FP32, FP32_BYTES = "float32", 4


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


def chunk_bounds(seq_len: int, degree: int, rank: int) -> list[tuple[int, int]]:
    """The two [start, stop) ranges of positions rank `rank` holds."""
    chunk = seq_len // (2 * degree)
    return [(rank * chunk, (rank + 1) * chunk), ((2 * degree - 1 - rank) * chunk, (2 * degree - rank) * chunk)]


def local_positions(seq_len: int, degree: int, rank: int) -> np.ndarray:
    """Positions (int64) of the tokens rank `rank` holds, in its order."""
    return np.concatenate([np.arange(start, stop) for start, stop in chunk_bounds(seq_len, degree, rank)])


def split_sequence(x, degree: int, rank: int, axis: int = 1):
    """This rank's tokens of a [batch, seq, ...] array or tensor (its two chunks, concatenated)."""
    seq_len = x.shape[axis]
    if isinstance(x, np.ndarray):
        return np.take(x, local_positions(seq_len, degree, rank), axis=axis)
    return paddle.concat([paddle.slice(x, [axis], [start], [stop])
                          for start, stop in chunk_bounds(seq_len, degree, rank)], axis=axis)


class _BlockwiseKernel:
    """The blockwise core's kernel in the ring: queries as rows [batch, kv_heads, seq x groups,
    head_dim] (scaled before the kernel), k and v as [batch, kv_heads, seq, head_dim]; positions on
    axis 2 of both, the log-sum-exp [batch, kv_heads, rows, 1]."""

    axis = 2

    def __init__(self, q_shape, kv_heads: int, seq_first: bool, block: int):
        self.heads, self.head_dim = q_shape[2], q_shape[3]
        self.kv_heads, self.seq_first, self.block = kv_heads, seq_first, block
        self.groups, self.scale = self.heads // kv_heads, 1 / math.sqrt(self.head_dim)

    def queries(self, t, scaled: bool = False):
        """q, an output or its gradient ([.., heads, head_dim] or [.., heads x head_dim]) as rows."""
        rows = to_rows(t.reshape(t.shape[:2] + [self.heads, self.head_dim]), self.kv_heads, self.seq_first)
        return rows * self.scale if scaled else rows

    def keys(self, t):
        return to_heads(t, self.seq_first)

    def attend(self, q, k, v, causal: bool):
        return attend(q, k, v, self.groups, causal, self.block, out_dtype=FP32)

    def attend_backward(self, q, k, v, out, lse, dout, causal: bool):
        grads = attend_backward(q, k, v, out, lse, dout, self.groups, causal, self.block)
        return [grad.astype(FP32) for grad in grads]

    def output(self, out, dtype):
        return from_rows(out.astype(dtype), self.groups, self.seq_first)

    def query_grad(self, dq, like):
        return from_rows((dq * self.scale).astype(like.dtype), self.groups, self.seq_first).reshape(like.shape)

    def key_grad(self, grad, like):
        return grad.astype(like.dtype).transpose([2, 0, 1, 3] if self.seq_first else [0, 2, 1, 3])


class _FlashKernel:
    """Paddle's flash kernel in the ring (GPU, bf16/fp16; untested here): everything [batch, seq,
    heads, head_dim], positions on axis 1, the log-sum-exp [batch, seq, heads, 1] while merging and
    [batch, heads, seq] for the kernel, as PaddleNLP's ring keeps them."""

    axis = 1

    def __init__(self, q_shape, kv_heads: int, seq_first: bool, block: int):
        self.heads, self.head_dim, self.seq_first = q_shape[2], q_shape[3], seq_first

    def _batch_first(self, t):
        return t.transpose([1, 0, 2, 3]) if self.seq_first else t

    def queries(self, t, scaled: bool = False):
        return self._batch_first(t.reshape(t.shape[:2] + [self.heads, self.head_dim]))

    keys = _batch_first

    def attend(self, q, k, v, causal: bool):
        out, lse = flash_block(q, k, v, causal)
        return out.astype(FP32), lse.transpose([0, 2, 1]).unsqueeze(-1)

    def attend_backward(self, q, k, v, out, lse, dout, causal: bool):
        grads = flash_block_backward(q, k, v, out.astype(q.dtype), lse.squeeze(-1).transpose([0, 2, 1]).contiguous(), dout,
                                     causal)
        return [grad.astype(FP32) for grad in grads]

    def output(self, out, dtype):
        out = out.astype(dtype)
        out = out.reshape(out.shape[:2] + [-1])
        return out.transpose([1, 0, 2]) if self.seq_first else out

    def query_grad(self, dq, like):
        return self._batch_first(dq.astype(like.dtype))

    def key_grad(self, grad, like):
        return self._batch_first(grad.astype(like.dtype))


def _part(t, axis: int, start: int, stop: int | None = None):
    return paddle.slice(t, [axis], [start], [t.shape[axis] if stop is None else stop])


def _merge(out, lse, part_out, part_lse):
    """Two partial attentions of the same queries (fp32 outputs, their log-sum-exps) merged into one."""
    new_lse = paddle.maximum(lse, part_lse) + paddle.log1p(paddle.exp(-paddle.abs(lse - part_lse)))
    return out * paddle.exp(lse - new_lse) + part_out * paddle.exp(part_lse - new_lse), new_lse


def _merge_second_half(out, lse, part_out, part_lse, axis: int):
    half = out.shape[axis] // 2
    merged = _merge(_part(out, axis, half), _part(lse, axis, half), part_out, part_lse)
    return [paddle.concat([_part(whole, axis, 0, half), new], axis=axis) for whole, new in zip((out, lse), merged)]


def _sees_all_of_first_chunk(ring: Ring, step: int) -> bool:
    """Whether the k and v arriving at `step` came from an earlier rank (its first chunk precedes
    both of ours: every local query sees that chunk) rather than a later one (only our second chunk
    sees them, both chunks)."""
    return (ring.rank - step) % ring.degree < ring.rank


class _RingAttention(PyLayer):
    """Causal attention of this rank's queries on the whole sequence's keys and values, the latter
    passed around the ring; keeps q, k, v as given, the output and the log-sum-exp (as the blockwise
    core does: the output projection keeps the same output tensor)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, kernel_type: type, seq_first: bool, block: int):
        kernel = kernel_type(q.shape, k.shape[2], seq_first, block)
        axis = kernel.axis
        with full_precision():
            q_local, kv = kernel.queries(q, scaled=True), [kernel.keys(k), kernel.keys(v)]
            arriving = ring.start_shift(kv) if ring.degree > 1 else None
            out, lse = kernel.attend(q_local, *kv, True)
            for step in range(1, ring.degree):
                kv = arriving()
                if step + 1 < ring.degree:  # the next block travels while this one computes
                    arriving = ring.start_shift(kv)
                if _sees_all_of_first_chunk(ring, step):
                    first = [_part(t, axis, 0, t.shape[axis] // 2) for t in kv]
                    out, lse = _merge(out, lse, *kernel.attend(q_local, *first, False))
                else:
                    second = _part(q_local, axis, q_local.shape[axis] // 2)
                    out, lse = _merge_second_half(out, lse, *kernel.attend(second, *kv, False), axis)
            result = kernel.output(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.setting = (ring, kernel)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensor()
        ring, kernel = ctx.setting
        axis = kernel.axis
        with full_precision():
            q_local, out_local, dout_local = kernel.queries(q, scaled=True), kernel.queries(out), kernel.queries(dout)
            kv = [kernel.keys(k), kernel.keys(v)]
            if ring.degree == 1:
                dq, dk, dv = kernel.attend_backward(q_local, *kv, out_local, lse, dout_local, True)
                return kernel.query_grad(dq, q), kernel.key_grad(dk, k), kernel.key_grad(dv, v)
            arriving = ring.start_shift(kv)
            dq, dk, dv = kernel.attend_backward(q_local, *kv, out_local, lse, dout_local, True)
            grads_arriving = ring.start_shift([dk, dv], "grad")
            half = q_local.shape[axis] // 2
            second = [_part(t, axis, half) for t in (q_local, out_local, lse, dout_local)]
            for step in range(1, ring.degree):
                keys, values = arriving()
                if step + 1 < ring.degree:
                    arriving = ring.start_shift([keys, values])
                if _sees_all_of_first_chunk(ring, step):
                    first = keys.shape[axis] // 2
                    part = kernel.attend_backward(q_local, _part(keys, axis, 0, first), _part(values, axis, 0, first),
                                                  out_local, lse, dout_local, False)
                    dq = dq + part[0]
                    key_grads, value_grads = grads_arriving()  # this block's gradients from the ranks before
                    key_grads, value_grads = (
                        paddle.concat([_part(grads, axis, 0, first) + new, _part(grads, axis, first)], axis=axis)
                        for grads, new in ((key_grads, part[1]), (value_grads, part[2])))
                else:
                    query, output, partial_lse, output_grad = second
                    part = kernel.attend_backward(query, keys, values, output, partial_lse, output_grad, False)
                    dq = paddle.concat([_part(dq, axis, 0, half), _part(dq, axis, half) + part[0]], axis=axis)
                    key_grads, value_grads = grads_arriving()
                    key_grads, value_grads = key_grads + part[1], value_grads + part[2]
                grads_arriving = ring.start_shift([key_grads, value_grads], "grad")
            dk, dv = grads_arriving()  # home: every rank's gradients of this rank's k and v
            return kernel.query_grad(dq, q), kernel.key_grad(dk, k), kernel.key_grad(dv, v)


KERNELS = {"blockwise": _BlockwiseKernel, "flash": _FlashKernel}


def ring_attention(q, k, v, ring: Ring, seq_first: bool = False, block: int = DEFAULT_BLOCK,
                   kernel: str = "blockwise"):
    """As `blockwise_causal_attention` for this rank's tokens of a sequence cut over `ring`, each
    block computed by `kernel` ("blockwise", or "flash": Paddle's kernel on GPU)."""
    return _RingAttention.apply(q, k, v, ring, KERNELS[kernel], seq_first, block)


@dataclass(frozen=True)
class RingCore(AttentionCore):
    """The attention core of a context-parallel run: the kernel of the core the run would take
    without cp (flash on GPU where it applies, blockwise elsewhere) on each block the ring brings.
    A rank keeps q, k, v, the merged output and its fp32 log-sum-exp for its own tokens, whichever
    the kernel (the blockwise core's model); the other ranks' k and v pass through."""

    name = "ring"
    ring: Any = None
    block: int = DEFAULT_BLOCK
    kernel: str = "blockwise"

    def __call__(self, q, k, v, seq_first):
        return ring_attention(q, k, v, self.ring, seq_first, self.block, self.kernel)

    def saved_bytes(self, batch, seq_len, heads, kv_heads, head_dim, dtype_bytes, seq_first) -> int:
        return BlockwiseCore(self.block).saved_bytes(batch, seq_len, heads, kv_heads, head_dim, dtype_bytes,
                                                     seq_first)

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
