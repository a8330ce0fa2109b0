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

import numpy as np
import paddle
from paddle import nn

from paddle_pp.runtime.experts import ExpertGroup


def expert_order(received: np.ndarray) -> np.ndarray:
    """The permutation putting a rank's received rows in expert order: `received[s, e]` rows came
    from source rank s for its local expert e, laid out by source then expert; the result lists
    expert 0's rows (by source), then expert 1's, and so on."""
    starts = np.cumsum(np.concatenate([[0], received.reshape(-1)]))[:-1].reshape(received.shape)
    sources, experts = received.shape
    return np.concatenate([np.arange(starts[s, e], starts[s, e] + received[s, e], dtype=np.int64)
                           for e in range(experts) for s in range(sources)] or [np.zeros([0], np.int64)])


def run_dispatched(flat: paddle.Tensor, chosen: paddle.Tensor, weights: paddle.Tensor, experts: nn.Layer,
                   group: ExpertGroup, num_experts: int) -> tuple[paddle.Tensor, list[int]]:
    """(the MoE output for this rank's tokens `flat` [tokens, hidden], routed to `chosen` with
    `weights` [tokens, k]; how many of its rows chose each expert). `experts` holds this rank's
    experts in order. An expert no row of the group chose runs on a zero row whose output, times
    zero, joins the result: its gradient is a zero, never missing."""
    choice = chosen.reshape([-1])
    order = paddle.argsort(choice, stable=True)  # (token, choice) rows by expert
    token_of = order // chosen.shape[1]
    counts = np.bincount(choice.numpy(), minlength=num_experts)
    local = len(group.local(num_experts))
    every = group.gather_counts(counts).reshape([group.degree, group.degree, local])  # [source, destination, expert]
    sent = every.sum(axis=2)
    received = group.exchange(paddle.gather(flat, token_of), sent)
    mine = every[:, group.rank]
    by_expert = paddle.to_tensor(expert_order(mine))
    outputs, idle = run_experts(paddle.gather(received, by_expert), mine.sum(axis=0).tolist(), experts)
    computed = paddle.scatter(paddle.zeros_like(received), by_expert, outputs) if outputs is not None else received
    returned = group.exchange(computed, sent.T)
    weighted = returned * paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
    return paddle.index_add(paddle.zeros_like(flat), token_of, 0, weighted) + idle, counts.tolist()


def run_experts(rows: paddle.Tensor, counts: list[int], experts: nn.Layer) -> tuple[paddle.Tensor | None, paddle.Tensor]:
    """(each expert's output on its rows, concatenated in expert order, or None when no row came; a
    zero scalar to add to the layer's output) for `rows` sorted by expert, `counts[e]` of them for
    the e-th of `experts`. One split, not a slice per expert: a slice's backward writes a zero tensor
    of the whole input, 64 of them per layer at 64 experts. An expert no row chose runs on one zero
    row whose output, times zero, is the scalar: its gradient is a zero, never missing."""
    slices = iter(paddle.split(rows, [count for count in counts if count])) if any(counts) else iter(())
    outputs, idle = [], paddle.zeros([], rows.dtype)
    for count, expert in zip(counts, experts.children()):
        if count:
            outputs.append(expert(next(slices)))
        else:
            idle = idle + (expert(paddle.zeros([1, rows.shape[1]], rows.dtype)) * 0).sum()
    return (paddle.concat(outputs) if outputs else None), idle
