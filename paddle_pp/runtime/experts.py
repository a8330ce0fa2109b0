"""Expert parallelism: the groups it needs, the token exchange, and the experts' own gradient reduction.

`Layout.ep` data ranks of one (stage, tp rank) form an expert group (`Layout.expert_position`): each
holds 1/ep of every MoE layer's experts, and tokens travel to the rank of the expert they chose and
back. The ranks holding the same experts are the experts' data replicas. So an expert's gradient on
its rank already sums the contributions of the whole expert group's tokens (they came back through
the exchange's backward); it is summed over the replicas stage1's sharding reduction has not
covered and divided so that, with what that reduction divided first, it is averaged over dp x
sharding as fleet averages the dense gradients (dividing by the replicas alone instead would
amplify the experts' gradients ep times). When ep divides dp, a group is ep dp ranks of one
sharding rank and its sharding peers hold the same experts: stage1 reduces them over the sharding
group (dividing by its size) like any parameter, then they are summed over the dp ranks of the same
expert rank and sharding rank, divided by dp. Otherwise the groups run across the
sharding ranks, stage1 partitions the experts over their replicas instead of the sharding group
(`runtime.expert_sharding`), and the replicas (dp x sharding x cp / ep ranks) divide by dp x
sharding themselves. Under tp every tp rank exchanges its own rows within its own expert group (experts stay
split over tp); under cp each cp rank its own part of the sequences, and the replicas include the
cp ranks, as fleet sums the dense gradients over dp x cp.

On GPU the exchange is Paddle's `alltoall_single` with per-rank counts; gloo has no all-to-all, so
on CPU the backend builds it from a padded all_gather (`backends.cpu.exchange_rows`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group

from paddle_pp.runtime.layout import Layout, LayoutError

EXPERT_MARK = "no_sync"  # Paddle's own mark: fleet's parameter broadcasts and DataParallel's reducer skip these


@dataclass(frozen=True)
class ExpertGroup:
    degree: int
    rank: int  # this rank's place in its expert group (which experts it holds)
    group: Any  # the expert group's ranks (the exchange)
    replicas: Any  # the ranks its experts' gradients are summed over (None: this rank alone); see the module's doc
    divisor: int  # what the sum over the replicas is divided by (see the module's doc)
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
        """Sum the experts' gradients over their replicas and divide by `divisor` (see the module's doc)."""
        if self.replicas is not None:
            fused_allreduce_gradients_with_group(params, self.replicas, scale=1.0 / self.divisor)
            return
        for param in params:
            grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
            if grad is not None:
                grad.scale_(1.0 / self.divisor)


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
    """This rank's expert group (`Layout.expert_position` of the data ranks of its stage, cp rank and
    tp rank) and the ranks its experts' gradients are summed over: the other data ranks of its expert
    rank (of its own sharding rank unless experts run across sharding, whose reduction stage1 did
    otherwise) in every cp rank, each having routed its own part of the sequences. Every rank creates
    every group, in one order. A group's ranks are sorted, as Paddle sorts them, so a rank's place in
    it must be its expert rank: checked."""
    topo, me = hcg.topology(), hcg.get_global_rank()
    groups: dict[tuple, dict[int, int]] = defaultdict(dict)  # {(stage, cp, tp, group): {expert rank: rank}}
    replicas: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(topo.world_size()):
        at = topo.get_coord(rank)
        group, expert_rank = layout.expert_position(at.data, at.sharding)
        groups[at.pipe, at.sep, at.model, group][expert_rank] = rank
        replicas[at.pipe, at.model, expert_rank, 0 if layout.experts_across_sharding else at.sharding].append(rank)
    ordered = [[members[e] for e in sorted(members)] for members in groups.values()]
    if any(ranks != sorted(ranks) for ranks in ordered):
        raise LayoutError(f"--hybrid_parallel_topo_order {layout.hybrid_parallel_topo_order}: an expert "
                          "group's ranks are not in expert order; use pp_first or sharding_first.")
    mine: dict[str, Any] = {}
    for kind, sets in (("group", ordered), ("replicas", list(replicas.values()))):
        for ranks in sets:
            made = dist.new_group(ranks) if len(ranks) > 1 else None
            if me in ranks:
                mine[kind] = made
    shared_by_sharding = 1 if layout.experts_across_sharding else layout.sharding_degree
    return ExpertGroup(degree=layout.ep, rank=layout.expert_rank(hcg.get_data_parallel_rank(),
                                                             hcg.get_sharding_parallel_rank()),
                       group=mine["group"], replicas=mine["replicas"],
                       divisor=layout.data_replicas // shared_by_sharding, device=layout.device)
