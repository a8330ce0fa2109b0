"""An MoE layer's experts under expert parallelism: each (token, choice) row travels to the rank of
its expert, the experts there run on what every rank of the expert group sent, and the outputs
travel back to be weighted and added. The exchange itself (counts, all-to-all, its backward) is
`paddle_pp/runtime/experts.py`; the single-rank path is `SparseMoE._local`.

Rows leave sorted by expert (so by destination rank, as the exchange wants them), arrive grouped
by source and within it by expert, and are regrouped by expert so each expert runs once on all its
rows. A token's k outputs are added in expert order, as on one rank. Dropless: every row is
exchanged, however unbalanced the routing.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from paddle_pp.runtime.experts import ExpertGroup

# runs this rank's experts on rows sorted by expert, `counts` each: (outputs in that order or None, the idle term)
Compute = Callable[[paddle.Tensor, list[int]], "tuple[paddle.Tensor | None, paddle.Tensor]"]


def expert_order(received: np.ndarray, stride: int | None = None) -> np.ndarray:
    """The permutation putting rows in expert order: `received[s, e]` rows came from source rank s
    for local expert e, laid out by source then expert, each source's right after the previous one's
    (or, with `stride`, source s's from row s x stride: rows gathered padded); the result lists expert
    0's rows (by source), then expert 1's, and so on."""
    sources, experts = received.shape
    firsts = (np.arange(sources) * stride if stride is not None else
              np.concatenate([[0], np.cumsum(received.sum(axis=1))[:-1]]))
    starts = firsts[:, None] + np.cumsum(received, axis=1) - received
    return np.concatenate([np.arange(starts[s, e], starts[s, e] + received[s, e], dtype=np.int64)
                           for e in range(experts) for s in range(sources)] or [np.zeros([0], np.int64)])


def run_dispatched(flat: paddle.Tensor, chosen: paddle.Tensor, weights: paddle.Tensor, compute: Compute,
                   group: ExpertGroup, num_experts: int, on_input: bool = False) -> tuple[paddle.Tensor, list[int]]:
    """(the MoE output for this rank's tokens `flat` [tokens, hidden], routed to `chosen` with
    `weights` [tokens, k]; how many of its rows chose each expert). `compute(rows, counts)` runs this
    rank's experts in order on rows sorted by expert (`run_experts`, or `run_experts_over_tp`). An
    expert no row of the group chose runs on a zero row whose output, times zero, joins the result:
    its gradient is a zero, never missing. `on_input`: the weights scale the rows sent, not the rows
    returned (Llama 4)."""
    choice = chosen.reshape([-1])
    order = paddle.argsort(choice, stable=True)  # (token, choice) rows by expert
    token_of = order // chosen.shape[1]
    counts = np.bincount(choice.numpy(), minlength=num_experts)
    local = len(group.local(num_experts))
    every = group.gather_counts(counts).reshape([group.degree, group.degree, local])  # [source, destination, expert]
    sent = every.sum(axis=2)
    row_weights = paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
    rows = paddle.gather(flat, token_of)
    received = group.exchange(rows * row_weights if on_input else rows, sent)
    mine = every[:, group.rank]
    by_expert = paddle.to_tensor(expert_order(mine))
    outputs, idle = compute(paddle.gather(received, by_expert), mine.sum(axis=0).tolist())
    computed = paddle.scatter(paddle.zeros_like(received), by_expert, outputs) if outputs is not None else received
    returned = group.exchange(computed, sent.T)
    weighted = returned if on_input else returned * row_weights
    return paddle.index_add(paddle.zeros_like(flat), token_of, 0, weighted) + idle, counts.tolist()


def run_experts(rows: paddle.Tensor, counts: list[int], experts: nn.Layer,
                apply: Callable[[nn.Layer, paddle.Tensor], paddle.Tensor] = nn.Layer.__call__,
                ) -> tuple[paddle.Tensor | None, paddle.Tensor]:
    """(each expert's output on its rows, concatenated in expert order, or None when no row came; a
    zero scalar to add to the layer's output) for `rows` sorted by expert, `counts[e]` of them for
    the e-th of `experts`. One split, not a slice per expert: a slice's backward writes a zero tensor
    of the whole input, 64 of them per layer at 64 experts. An expert no row chose runs on one zero
    row whose output, times zero, is the scalar: its gradient is a zero, never missing. `apply(expert,
    rows)` computes an expert (its layer's call, or under SP its partial sums: `run_experts_over_tp`)."""
    slices = iter(paddle.split(rows, [count for count in counts if count])) if any(counts) else iter(())
    outputs, idle = [], paddle.zeros([], rows.dtype)
    for count, expert in zip(counts, experts.children()):
        if count:
            outputs.append(apply(expert, next(slices)))
        else:
            idle = idle + (apply(expert, paddle.zeros([1, rows.shape[1]], rows.dtype)) * 0).sum()
    return (paddle.concat(outputs) if outputs else None), idle


def expert_partial_sum(expert: nn.Layer, rows: paddle.Tensor) -> paddle.Tensor:
    """An expert (`blocks.mlp`'s layers, their projections split over tp as fleet's column and row
    linears split them) on `rows` every tp rank holds, without their collectives (`partial_sum`)."""
    return expert.partial_sum(rows)


def _output_bias(expert: nn.Layer) -> paddle.Tensor | None:
    return getattr(expert, expert.declared.names[-1]).bias


def run_experts_over_tp(rows: paddle.Tensor, counts: list[int], experts: nn.Layer, group: Any,
                        shared: tuple[nn.Layer, paddle.Tensor] | None = None,
                        ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
    """`run_experts` under sequence parallelism, where each tp rank brings its own rows (`counts` of
    each of this rank's experts, sorted by expert) and, for the shared expert (`shared`: its layer and
    this rank's tokens), its own positions: both gathered from every tp rank in one all-gather (the
    rows padded to the most any rank holds; backward: the input gradients reduce-scattered, each
    rank's share of the intermediate having given a part of them), each expert's partial sums on its
    rows, the shared expert's on the whole sequence, and each rank's own rows' and positions' sums
    back in one reduce-scatter (backward: every rank gets the gradient of every row, which its share of
    the projections needs), output biases added. (this rank's rows' outputs [rows, hidden], the idle
    experts' zero term, its positions' shared-expert output or None). One collective pair per layer,
    and every tp rank runs the same ones in the same order whatever it holds: the backward of a
    collective left off one rank's graph would wait forever on the others."""
    held = paddle.to_tensor(np.asarray(counts, np.int64))
    every = [paddle.zeros_like(held) for _ in range(group.nranks)]
    dist.all_gather(every, held, group=group)
    every = np.stack([count.numpy() for count in every])  # [tp rank, expert]
    most, own = max(int(every.sum(axis=1).max()), 1), rows.shape[0]  # never an empty gather: one zero row at least
    tokens = shared[1] if shared is not None else rows[:0]
    stride = most + tokens.shape[0]  # a rank's block: its rows padded to `most`, then its positions
    # rows narrower than the tokens (latent experts: Nemotron-H's) ride with zero columns after theirs
    width, narrow = max(rows.shape[1], tokens.shape[1]), rows.shape[1]
    block = paddle.concat([_widened(rows, width), paddle.zeros([most - own, width], rows.dtype), _widened(tokens, width)])
    gathered = sp_utils.AllGatherOp.apply(block.contiguous())  # [tp x stride, width]
    by_expert = paddle.to_tensor(expert_order(every, stride))
    outputs, idle = run_experts(paddle.gather(gathered, by_expert)[:, :narrow], every.sum(axis=0).tolist(), experts,
                                expert_partial_sum)
    # with no row on any tp rank, a zero still made of the gathered rows: the rows' gradient must reach the
    # exchange that brought them (an empty one, but its backward is a collective the expert group's other ranks run)
    summed = paddle.zeros_like(gathered) if outputs is not None else gathered * 0.0
    if outputs is not None:
        summed = paddle.scatter(summed, by_expert, _widened(outputs, width))
    if shared is not None:
        positions = paddle.to_tensor(np.concatenate([np.arange(t * stride + most, (t + 1) * stride)
                                                     for t in range(group.nranks)]))
        summed = paddle.scatter(summed, positions, expert_partial_sum(shared[0], paddle.gather(gathered, positions)))
    mine = sp_utils.ReduceScatterOp.apply(summed)
    routed, shared_out = mine[:own, :narrow], (mine[most:] if shared is not None else None)
    biases = [_output_bias(expert) for expert in experts.children()]
    if biases[0] is not None:  # through one gather, so every bias has a gradient (a zero where no row chose it)
        expert_of_row = paddle.to_tensor(np.repeat(np.arange(len(counts)), counts).astype(np.int64))
        routed = routed + paddle.gather(paddle.stack(biases), expert_of_row)
    if shared is not None and _output_bias(shared[0]) is not None:
        shared_out = shared_out + _output_bias(shared[0])
    return routed, idle, shared_out


def _widened(x: paddle.Tensor, width: int) -> paddle.Tensor:
    """x [rows, w] with zero columns after its own up to `width` (itself when w is that)."""
    if x.shape[1] == width:
        return x
    return paddle.concat([x, paddle.zeros([x.shape[0], width - x.shape[1]], x.dtype)], axis=1)
