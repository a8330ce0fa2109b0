"""The context-parallel ring: the cp ranks that share each sequence, in order, and the two things
ring attention asks of it: start a shift of tensors one step along it (every rank sends to the
next and receives from the previous at once; the caller computes, then waits) and sum a tensor
over it.

On GPU the shift is one `batch_isend_irecv` on the cp group (NCCL posts both at once, as PaddleNLP's
ring does); untested here (no GPU). On CPU gloo pairs p2p messages by each group's running op count,
so the CPU backend gives every ring edge and stream (k/v, gradients) a 2-rank group of its own (as
for the pipeline's edges), its transfers running in threads while this one computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer


@dataclass(frozen=True)
class Ring:
    degree: int
    rank: int  # this rank's place in the ring (its cp rank)
    ranks: tuple[int, ...]  # the ring's global ranks, in ring order
    group: Any
    device: str

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.degree]

    @property
    def previous_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.degree]

    def start_shift(self, tensors: list[paddle.Tensor], stream: str = "kv") -> Callable[[], list[paddle.Tensor]]:
        """Start sending `tensors` to the next rank; the returned call waits and gives the same-shaped
        tensors the previous rank sent. One shift per `stream` ("kv" or "grad") is in flight at a time."""
        sent = [tensor.contiguous() for tensor in tensors]
        received = [paddle.empty(tensor.shape, tensor.dtype) for tensor in tensors]
        if self.device == "cpu":
            from paddle_pp.runtime.backends import cpu

            wait = cpu.start_ring_shift(sent, received, self.ranks[self.rank], self.next_rank, self.previous_rank,
                                        stream)
        else:
            operations = [dist.P2POp(dist.isend, tensor, self.next_rank, self.group) for tensor in sent]
            operations += [dist.P2POp(dist.irecv, tensor, self.previous_rank, self.group) for tensor in received]
            tasks = dist.batch_isend_irecv(operations)
            wait = lambda: [task.wait() for task in tasks]  # noqa: E731

        def finish() -> list[paddle.Tensor]:
            wait()
            del sent[:]  # kept until the sends are done
            return received

        return finish

    def all_reduce(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The sum of `tensor` over the ring (a copy, outside autograd)."""
        total = tensor.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def pooled(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The sum over the ring of a statistic each rank took over its tokens (an MoE layer's summed
        router scores), inside autograd: its gradient reaches this rank's part as it is. Every cp rank
        computes the same loss term from the sum, and each token lives on one rank, so each token's
        scores get their single-card gradient once (the cp gradient reduction sums the ranks')."""
        return _PooledOverRing.apply(tensor, self)


class _PooledOverRing(PyLayer):
    @staticmethod
    def forward(ctx, tensor, ring):
        return ring.all_reduce(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def build_ring(hcg: Any, device: str) -> Ring:
    """This rank's cp ring (fleet's `sep` group), with the CPU backend's edge groups made first."""
    if device == "cpu":
        from paddle_pp.runtime.backends import cpu

        cpu.create_ring_edge_groups(hcg)
    group = hcg.get_sep_parallel_group()
    return Ring(len(group.ranks), hcg.get_sep_parallel_rank(), tuple(group.ranks), group, device)
