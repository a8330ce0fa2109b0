"""Context parallelism's split of a sequence over the cp ranks (the attention that runs around the
ring is `modeling/attention_core/ring.py`).

The split balances causal work (PaddleNLP's, Megatron's and torchtitan's head-tail split): each
sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, in order, so the
positions it holds increase and attention on its own tokens is plain causal attention. Everything
else is position-wise and needs nothing but the positions themselves (`local_positions`: rotary
tables, learned positions). The loss is a sum over cp ranks of each rank's summed token losses
over the count of the whole sequence's counted labels (not a mean of means).

Weights are whole on every cp rank: cp ranks are replicas of each other for the checkpoint and sum
their gradients (fleet's `sep` axis: all-reduced over dp x cp, averaged over dp only).
"""

from __future__ import annotations

import numpy as np
import paddle


def chunk_bounds(seq_len: int, degree: int, rank: int) -> list[tuple[int, int]]:
    """The two [start, stop) ranges of positions rank `rank` holds."""
    chunk = seq_len // (2 * degree)
    return [(rank * chunk, (rank + 1) * chunk), ((2 * degree - 1 - rank) * chunk, (2 * degree - rank) * chunk)]


def local_positions(seq_len: int, degree: int, rank: int) -> np.ndarray:
    """Positions (int64) of the tokens rank `rank` holds, in its order."""
    return np.concatenate([np.arange(start, stop) for start, stop in chunk_bounds(seq_len, degree, rank)])


def whole_sequence(x: paddle.Tensor, ring) -> paddle.Tensor:
    """The whole sequences [batch, seq] of integers (ids, labels, flags) of which `x` holds this rank's
    two chunks, in sequence order: each rank's values put in place and summed over the ring (one small
    all-reduce, in float64, exact for any id)."""
    batch, local = x.shape
    held = paddle.to_tensor(local_positions(local * ring.degree, ring.degree, ring.rank)).expand([batch, local])
    whole = paddle.zeros([batch, local * ring.degree], "float64").put_along_axis(held, x.astype("float64"), axis=1)
    return ring.all_reduce(whole).astype(x.dtype)


def ahead_in_sequence(x: paddle.Tensor, depth: int, fill: int, ring=None) -> paddle.Tensor:
    """Each position's value `depth` positions further on in its sequence ([batch, seq] integers), `fill`
    where the sequence has none; under context parallelism (`ring`) along the whole sequence, whose
    next chunk is on another rank, this rank's positions kept (multi-token prediction's tokens, labels
    and document positions)."""
    whole = x if ring is None or ring.degree == 1 else whole_sequence(x, ring)
    shifted = paddle.concat([whole[:, depth:], paddle.full_like(whole[:, :depth], fill)], axis=1)
    return shifted if whole is x else split_sequence(shifted, ring.degree, ring.rank)


def split_sequence(x, degree: int, rank: int, axis: int = 1):
    """This rank's tokens of a [batch, seq, ...] array or tensor (its two chunks, concatenated)."""
    seq_len = x.shape[axis]
    if isinstance(x, np.ndarray):
        return np.take(x, local_positions(seq_len, degree, rank), axis=axis)
    return paddle.concat([paddle.slice(x, [axis], [start], [stop])
                          for start, stop in chunk_bounds(seq_len, degree, rank)], axis=axis)

