"""Which sharding rank updates each parameter, by the rules of Paddle's sharding optimizers: what a
save plans its writers by (`checkpoint.save_plan`), and what experts across sharding ranks are
partitioned over their replicas by (`runtime.expert_sharding`)."""

from __future__ import annotations

import heapq


def sharding_owners(numels: list[int], sharding_degree: int) -> list[int]:
    """The sharding rank that updates each parameter (given in model order), by the rule of Paddle's
    DygraphShardingOptimizer._partition_parameters: largest first (stable), each to the rank
    with the fewest elements so far. Plans saves of models that are not built, and partitions
    experts across sharding ranks over their replicas at run time."""
    owners = [0] * len(numels)
    heap = [(0, rank) for rank in range(sharding_degree)]
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        size, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (size + numels[index], rank))
    return owners


def stage2_owners(numels: list[int], sharding_degree: int) -> list[int]:
    """The sharding rank that updates each parameter (in model order) under stage2, by the rule of
    Paddle's GroupShardedOptimizerStage2._segment_params: in order, each to the rank with the fewest
    elements so far (lowest rank on ties)."""
    sizes, owners = [0] * sharding_degree, []
    for numel in numels:
        owners.append(sizes.index(min(sizes)))
        sizes[owners[-1]] += numel
    return owners
