"""Recurrent layers under context parallelism, without a key/value ring.

Context parallelism gives rank r parts r and 2cp-1-r of each sequence (the head-tail split,
`context_parallel.py`). A recurrent mixer needs from the parts before each of its own only two small
things, never their keys and values:
- the conv's window: the last K-1 conv inputs of the part before (`conv_halos`);
- the state the rule reaches before the part. A part's effect on the state is affine, S_after = T
  S_before + L (`recurrent_core.part_summary`), so each rank summarises its two parts, the summaries
  (d_k x (d_k + d_v) per head) are gathered over the cp group, every rank folds them in sequence order
  (`recurrent_core.fold_states`) and runs its parts from the states before them (`rule_across_parts`).
Both exchanges are one all-reduce of a tensor holding every part's slot (`_GatheredParts`); their
backward all-reduces the gradients of all slots and hands each rank its own parts', so a state's
gradient reaches the rank whose keys and values made it. A part whose first token starts a document
starts from zero, as on one card; the gathered flags say which.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from modeling.recurrent_core import RecurrentCore, document_ids, fold_states


def part_slots(ring) -> tuple[int, int]:
    """The places in sequence order of this rank's two parts."""
    return ring.rank, 2 * ring.degree - 1 - ring.rank


class _GatheredParts(PyLayer):
    """[2, ...] (this rank's two parts' tensors) -> [2 cp, ...] (every part's, in sequence order)."""

    @staticmethod
    def forward(ctx, mine, ring):
        ctx.ring = ring
        first, second = part_slots(ring)
        rows = [paddle.zeros_like(mine[0])] * (2 * ring.degree)
        rows[first], rows[second] = mine[0], mine[1]
        return ring.all_reduce(paddle.stack(rows))

    @staticmethod
    def backward(ctx, grad):
        total = ctx.ring.all_reduce(grad)
        first, second = part_slots(ctx.ring)
        return paddle.stack([total[first], total[second]])


def gather_parts(mine, ring):
    return _GatheredParts.apply(mine, ring)


def conv_halos(x, kernel: int, ring) -> list:
    """For each of this rank's two parts of x [batch, 2c, channels] (the conv's input), the last
    kernel - 1 rows of the part before it in the sequence (zeros before the first)."""
    half, taps = x.shape[1] // 2, kernel - 1
    tails = gather_parts(paddle.stack([x[:, half - taps:half], x[:, 2 * half - taps:]]), ring)
    return [paddle.zeros_like(tails[0]) if slot == 0 else tails[slot - 1] for slot in part_slots(ring)]


def conv_by_parts(conv, x, positions, ring):
    """`conv` (a `DepthwiseCausalConv`) on each of this rank's two parts of x [batch, 2c, channels],
    each after the last inputs of the part before it."""
    half = x.shape[1] // 2
    halos = conv_halos(x, conv.weight.shape[-1], ring)
    return paddle.concat([conv(x[:, start:start + half], None if positions is None else positions[:, start:start + half],
                               halo) for start, halo in zip((0, half), halos)], axis=1)


def rule_across_parts(core: RecurrentCore, q, k, v, g, beta, positions, ring):
    """The rule's output [batch, 2c, heads, d_v] on this rank's two parts (q, k, v, g, beta as
    `RecurrentCore` takes them, each part c tokens), from the states the parts before leave;
    `positions` (each token's position in its document, or None for one stream) restart it."""
    half = k.shape[1] // 2
    pieces = [[None if x is None else x[:, start:start + half] for x in (q, k, v, g, beta)]
              for start in (0, half)]
    segments = [None if positions is None else document_ids(positions[:, start:start + half]) for start in (0, half)]
    summaries = [paddle.concat(core.summary(*piece[1:], segments=part_segments), axis=-1)
                 for piece, part_segments in zip(pieces, segments)]
    every = gather_parts(paddle.stack(summaries), ring)  # [2cp, batch, heads, d_k, d_k + d_v]
    d_k = k.shape[-1]
    starts = None
    if positions is not None:
        flags = paddle.stack([positions[:, 0] == 0, positions[:, half] == 0]).astype("float32")
        starts = [flag > 0 for flag in gather_parts(flags, ring)]
    before = fold_states([(part[..., :d_k], part[..., d_k:]) for part in every], starts)
    outputs = [core(*piece, initial_state=before[slot], segments=part_segments)[0]
               for piece, part_segments, slot in zip(pieces, segments, part_slots(ring))]
    return paddle.concat(outputs, axis=1)

