"""Who writes each tensor of a save: every rank of the job takes a share, balanced by bytes.

Each tensor (model weight, optimizer state, recorded gradient) is written once, as its single-card
tensor, by one rank of the lowest pipeline stage that holds it. Any weight replica (dp x sharding
x cp index: `Layout.weight_replica`) holding it may write it: model weights are held by every
replica, an optimizer state by the replicas of the sharding rank that updates it. A TP-split
tensor is written in place: each rank of the writer's tp group writes its piece into the writer's
file (a stage3 flat slice is first gathered over its sharding group, to the member in the
writer's replica). Tensors go largest first
to the least-loaded rank that can write them (LPT scheduling; a TP-split tensor loads each rank of
the tp group with its piece, and goes to the rank with the smallest files among equally loaded ones),
so a job with data parallelism spreads its save over all its ranks instead of leaving the writing
to the first replica. The assignment is a pure function of the tensors and the layout: every
rank computes the same one, and the planner computes it for a model that was never built.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

# One rank of the job: (pipeline stage, weight replica, tp rank). Its expert rank is its dp rank's
# (`Layout.expert_rank`), so a tensor one expert rank holds is held by some of the replicas only.
Slot = tuple[int, int, int]


@dataclass(frozen=True)
class WriteItem:
    kind: str  # model, optimizer, gradients
    name: str
    nbytes: int  # bytes of the single-card tensor, as written
    split: bool  # split over tp: each tp rank of the writer's replica writes its piece in place
    gathered: int  # bytes each rank writing (a piece of) it receives first: stage3 slices of other sharding ranks
    holders: tuple[tuple[int, int], ...]  # (stage, weight replica) pairs that hold it


@dataclass
class WritePlan:
    """Which rank writes each tensor, and what that costs each rank."""

    writer: dict[tuple[str, str], Slot]
    written: dict[Slot, int]  # bytes each rank writes (its own files' bytes and its pieces in others')
    received: dict[Slot, int]  # bytes each rank receives before writing (stage3 slice gathers)


def assign_writers(items: Iterable[WriteItem], tp: int) -> WritePlan:
    """LPT: largest tensor first, to the least-loaded rank among its lowest stage's holders (ties
    to the lowest slot, so the result is the same on every rank)."""
    written: dict[Slot, int] = defaultdict(int)
    filed: dict[Slot, int] = defaultdict(int)  # bytes of each rank's files
    received: dict[Slot, int] = defaultdict(int)
    writer: dict[tuple[str, str], Slot] = {}
    for item in sorted(items, key=lambda i: (-i.nbytes, i.kind, i.name)):
        stage = min(stage for stage, _ in item.holders)
        candidates = [(stage, replica, t) for s, replica in sorted(set(item.holders)) if s == stage for t in range(tp)]
        slot = min(candidates, key=lambda c: (written[c], filed[c], c))
        writer[(item.kind, item.name)] = slot
        filed[slot] += item.nbytes
        pieces = [(slot[0], slot[1], t) for t in range(tp)] if item.split and tp > 1 else [slot]
        for piece in pieces:
            written[piece] += item.nbytes // len(pieces)
            received[piece] += item.gathered
    return WritePlan(writer, dict(written), dict(received))


def gathered_bytes(nbytes: int, split: bool, tp: int, slices: int) -> int:
    """What each rank writing (a TP piece of) a tensor of `nbytes` receives first when stage3 holds
    it as `slices` flat slices (1: not sliced): the other slices of its piece."""
    piece = nbytes // tp if split else nbytes
    return piece * (slices - 1) // slices


def items_from_holdings(holdings: list[dict]) -> list[WriteItem]:
    """Write items from every rank's holdings ({"stage", "replica", "tensors": {kind: {name: [nbytes,
    split, gathered]}}}, one per rank, as gathered at save time)."""
    merged: dict[tuple[str, str], tuple[int, bool, int, set]] = {}
    for rank in holdings:
        for kind, tensors in rank["tensors"].items():
            for name, (nbytes, split, gathered) in tensors.items():
                holders = merged.setdefault((kind, name), (nbytes, split, gathered, set()))[3]
                holders.add((rank["stage"], rank["replica"]))
    return [WriteItem(kind, name, nbytes, split, gathered, tuple(sorted(holders)))
            for (kind, name), (nbytes, split, gathered, holders) in merged.items()]
