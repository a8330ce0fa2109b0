"""What one rank does in a save, as data: a pure function of the write plan and what the rank holds.

`save_tasks` turns the job's `WritePlan` (`checkpoint.writers.assign_writers`) into one rank's part
of saving one kind: the file it writes and that file's layout, and for each tensor it takes part
in, whether it writes it whole into that file, writes its TP piece into the place the tensor has
in its tp group's writer's file, or only sends its stage3 slice to the sharding peer that gathers
it. Every rank of a tp group computes the layouts of its peers' files from the same plan, so a
piece's place needs no message. The save (`checkpoint.save`) carries the tasks out in order; a
test can check them for a whole job without a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpoint.format import shard_name
from checkpoint.piece import Piece
from checkpoint.shards import TensorSpec, shard_layout
from checkpoint.writers import Slot, WritePlan, gathered_bytes

SHARD_METADATA = {"format": "np"}
WHOLE_INTO_OWN_FILE, PIECE_IN_PLACE, SEND_SLICE = "whole", "piece", "send"


@dataclass(frozen=True)
class Holding:
    """A tensor this rank could write: the single-card tensor as written, and the part it holds."""

    spec: TensorSpec
    piece: Piece


@dataclass(frozen=True)
class Place:
    """Where a TP piece goes: the single-card tensor's bytes in its writer's shard file."""

    fname: str
    offset: int
    file_size: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Task:
    """One tensor this rank takes part in saving. A stage3 slice is first gathered over its sharding
    group to `slice_root` (the member in the writer's data replica), then written as `action` says."""

    name: str
    piece: Piece
    action: str  # WHOLE_INTO_OWN_FILE, PIECE_IN_PLACE or SEND_SLICE
    slice_root: int
    place: Place | None = None  # PIECE_IN_PLACE: where


@dataclass(frozen=True)
class KindTasks:
    """One rank's part in saving one kind: its own file (None: it writes none of this kind), that
    file's tensors in order, those of them its tp group writes in place (`holes`), and its tasks in
    the order every rank takes them (sorted by name, so stage3 gathers pair up)."""

    kind: str
    fname: str | None
    specs: tuple[TensorSpec, ...]
    holes: frozenset[str]
    tasks: tuple[Task, ...]


def holding_sizes(holdings: dict[str, dict[str, Holding]], tp: int) -> dict[str, dict[str, list]]:
    """What a rank reports it could write, by kind, for `writers.items_from_holdings`: each tensor's
    single-card bytes, whether TP splits it, and the bytes its writer gathers first (stage3)."""
    return {kind: {name: [h.spec.nbytes, h.piece.split, gathered_bytes(h.spec.nbytes, h.piece.split, tp, h.piece.slices)]
                   for name, h in tensors.items()}
            for kind, tensors in holdings.items()}


def writer_files(plan: WritePlan, holdings: list[dict], kinds: list[str]) -> dict[str, dict[Slot, str]]:
    """Each writer's shard file name per kind: writers of a kind are numbered in rank order."""
    rank_of = {(h["stage"], h["replica"], h["tp_rank"]): h["rank"] for h in holdings}
    names: dict[str, dict[Slot, str]] = {}
    for kind in kinds:
        slots = sorted({slot for (k, _), slot in plan.writer.items() if k == kind}, key=rank_of.__getitem__)
        names[kind] = {slot: shard_name(kind, number + 1, len(slots)) for number, slot in enumerate(slots)}
    return names


def save_tasks(kind: str, held: dict[str, Holding], plan: WritePlan, files: dict[Slot, str], rank: Slot,
               tp: int, sharding: int) -> KindTasks:
    """Rank `rank`'s (stage, weight replica, tp rank) tasks for `kind`, from what it holds (`held`,
    the same names on every tp rank of its (stage, replica)), the job's `plan`, each writer's file
    name of this kind (`files`), and the tp and sharding degrees."""
    stage, replica, tp_rank = rank
    file_specs: dict[int, list[TensorSpec]] = {t: [] for t in range(tp)}  # each tp rank's file in this group
    tasks: list[tuple[str, Piece, str, int, int | None]] = []  # (name, piece, action, slice root, writer)
    for name in sorted(held):
        holding = held[name]
        w_stage, w_replica, writer = plan.writer[(kind, name)]
        ours = (w_stage, w_replica) == (stage, replica)
        if ours:
            file_specs[writer].append(holding.spec)
        split = holding.piece.split
        if holding.piece.flat is not None:  # every sharding peer of a tp rank that takes part gathers with it
            near = (w_stage, w_replica // sharding) == (stage, replica // sharding)
        else:
            near = ours
        if not near or not (split or writer == tp_rank):
            continue
        action = SEND_SLICE if not ours else PIECE_IN_PLACE if split else WHOLE_INTO_OWN_FILE
        tasks.append((name, holding.piece, action, w_replica % sharding, writer))
    layouts = {t: shard_layout(specs, SHARD_METADATA) for t, specs in file_specs.items() if specs}

    def place(name: str, writer: int) -> Place:
        starts, size = layouts[writer]
        return Place(files[(stage, replica, writer)], starts[name], size, held[name].spec.shape)

    specs = tuple(file_specs[tp_rank])
    return KindTasks(kind, files.get(rank), specs,
                     frozenset(spec.name for spec in specs if held[spec.name].piece.split),
                     tuple(Task(name, piece, action, root, place(name, writer) if action == PIECE_IN_PLACE else None)
                           for name, piece, action, root, writer in tasks))
