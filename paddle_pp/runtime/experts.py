"""Expert parallelism: the groups it needs, the token exchange, and the experts' own gradient reduction.

`Layout.ep` dp ranks of one (stage, tp rank, sharding rank) form an expert group: each holds 1/ep of
every MoE layer's experts, and tokens travel to the rank of the expert they chose and back. The
ranks holding the same experts (every ep-th dp rank: dp / ep of them) are the experts' data
replicas. So an expert's gradient on its rank already sums the contributions of the whole expert
group's tokens (they came back through the exchange's backward); it is summed over the replicas and
divided by dp, as fleet divides the dense gradients (dividing by the replicas alone instead would
amplify the experts' gradients ep times). Under tp every tp rank exchanges the same tokens within
its own expert group (experts stay split over tp), so the tp layers' own all-reduces need nothing new.

On GPU the exchange is Paddle's `alltoall_single` with per-rank counts; gloo has no all-to-all, so
on CPU the backend builds it from a padded all_gather (`backends.cpu.exchange_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group

from paddle_pp.runtime.layout import Layout

EXPERT_MARK = "no_sync"  # Paddle's own mark: fleet's parameter broadcasts and DataParallel's reducer skip these


@dataclass(frozen=True)
class ExpertGroup:
    degree: int
    rank: int  # this rank's place in its expert group (which experts it holds)
    group: Any  # the expert group's ranks (the exchange)
    replicas: Any  # the ranks holding the same experts (None when there is one: dp == ep)
    dp: int  # the data-parallel degree the gradients are averaged over
    device: str

    def local(self, num_experts: int) -> range:
        return local_experts(num_experts, self.degree, self.rank)

    def gather_counts(self, counts: np.ndarray) -> np.ndarray:
        """Every expert-group rank's `counts` (tokens it routes to each expert), by rank: [ep, experts]."""
        gathered: list = []
        dist.all_gather(gathered, paddle.to_tensor(counts.astype(np.int64)), group=self.group)
        return np.stack([t.numpy() for t in gathered])

    def exchange(self, rows: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        """Send rows to the other ranks of the group and receive theirs, in autograd (the backward
        sends the gradients home). `counts[s, d]`: rows rank s sends rank d, every rank's `rows`
        ordered by destination; the result holds what this rank receives, ordered by source."""
        return _Exchange.apply(rows, counts, self)

    def exchange_rows(self, rows: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        if self.device == "cpu":
            from paddle_pp.runtime.backends import cpu

            return cpu.exchange_rows(rows, counts, self.rank, self.group)
        received = paddle.empty([int(counts[:, self.rank].sum()), *rows.shape[1:]], rows.dtype)
        dist.alltoall_single(received, rows.contiguous(), in_split_sizes=counts[self.rank].tolist(),
                             out_split_sizes=counts[:, self.rank].tolist(), group=self.group)
        return received

    def reduce_gradients(self, params: list) -> None:
        """Sum the experts' gradients over their replicas and divide by dp (see the module's doc)."""
        if self.replicas is not None:
            fused_allreduce_gradients_with_group(params, self.replicas, scale=1.0 / self.dp)
            return
        for param in params:
            grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
            if grad is not None:
                grad.scale_(1.0 / self.dp)


class _Exchange(PyLayer):
    @staticmethod
    def forward(ctx, rows, counts, experts):
        ctx.counts, ctx.experts = counts, experts
        return experts.exchange_rows(rows, counts)

    @staticmethod
    def backward(ctx, grad):
        return ctx.experts.exchange_rows(grad, ctx.counts.T)


def local_experts(num_experts: int, ep: int, expert_rank: int) -> range:
    """The global ids of the experts a rank of expert rank `expert_rank` holds (a contiguous 1/ep)."""
    per_rank = num_experts // ep
    return range(expert_rank * per_rank, (expert_rank + 1) * per_rank)


def mark_experts(layer: paddle.nn.Layer) -> None:
    """Mark a rank's expert parameters: they differ between the ranks of an expert group, so no
    broadcast may copy one rank's over another's and no dp all-reduce may mix them."""
    for param in layer.parameters():
        setattr(param, EXPERT_MARK, True)


def is_expert(param) -> bool:
    return getattr(param, EXPERT_MARK, False)


def build_expert_group(hcg: Any, layout: Layout) -> ExpertGroup:
    """This rank's expert group (ep consecutive dp ranks) and replica group (the dp ranks of its
    `Layout.expert_rank`); every rank creates every group, in one order."""
    me, ep = hcg.get_global_rank(), layout.ep
    mine: dict[str, Any] = {}
    for dp_ranks in hcg.topology().get_comm_list("data"):
        blocks = [dp_ranks[i:i + ep] for i in range(0, len(dp_ranks), ep)]
        replica_sets = [[rank for dp, rank in enumerate(dp_ranks) if layout.expert_rank(dp) == e] for e in range(ep)]
        for kind, sets in (("group", blocks), ("replicas", replica_sets)):
            for ranks in sets:
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if me in ranks:
                    mine[kind] = group
    return ExpertGroup(ep, layout.expert_rank(hcg.get_data_parallel_rank()), mine["group"], mine["replicas"],
                       layout.dp, layout.device)
