"""The ranks that each hold a part of the same sequences' tokens in a mixture-of-experts layer, and
the sums over them that make a routing statistic the whole sequences' again.

Under sequence parallelism each tp rank routes its own positions (`blocks/moe.py`); under context
parallelism each cp rank its two chunks; under both, a tp rank of a cp rank its part of those. The
balance losses are products of sums over a sequence's tokens (expert shares times mean scores), so
the parts' sums are pooled first: the counts outside autograd, the scores inside it with a gradient
that reaches each rank's part as it is (every part computes the same loss term from the pooled sum,
each token lives on one rank, so each token's scores get their single-card gradient once; the
router's gradient, partial on each rank, is then summed as the layout sums it: over tp for a weight
marked as sequence-parallel, over cp by the data-parallel reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed import collective


@dataclass(frozen=True)
class TokenParts:
    tp_group: Any | None  # the tp ranks under sequence parallelism
    ring: Any | None  # the cp ring (`paddle_pp.runtime.ring.Ring`)

    @property
    def degree(self) -> int:
        """Into how many parts each sequence is cut."""
        return (self.tp_group.nranks if self.tp_group is not None else 1) * (self.ring.degree if self.ring else 1)

    def all_reduce(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The sum over the parts (a copy, outside autograd)."""
        total = tensor.detach().clone()
        if self.tp_group is not None:
            dist.all_reduce(total, group=self.tp_group)
        return self.ring.all_reduce(total) if self.ring is not None else total

    def pooled(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The sum over the parts inside autograd, its gradient reaching this rank's part as it is."""
        if self.tp_group is not None:
            tensor = collective._mp_allreduce(tensor, group=self.tp_group)  # forward sum, backward identity
        return self.ring.pooled(tensor) if self.ring is not None else tensor


def token_parts(tp_group: Any | None, ring: Any | None) -> TokenParts | None:
    """The parts of a run's sequences (None: each rank routes whole sequences)."""
    return TokenParts(tp_group, ring) if tp_group is not None or ring is not None else None
