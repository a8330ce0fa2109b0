"""`save_tasks` for every rank of a job, checked without a process: each single-card tensor ends up
in exactly one file, whole or as all its TP pieces at the places its writer's own layout gives
them, and stage3 gathers pair up across the sharding group (same tensors, same order, same root)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from checkpoint.format import MODEL, OPTIMIZER
from checkpoint.piece import FlatRange, Piece
from checkpoint.save_tasks import (
    PIECE_IN_PLACE,
    SEND_SLICE,
    SHARD_METADATA,
    WHOLE_INTO_OWN_FILE,
    Holding,
    holding_sizes,
    save_tasks,
    writer_files,
)
from checkpoint.shards import TensorSpec, shard_layout
from checkpoint.writers import assign_writers, items_from_holdings

# name -> (stage, single-card shape, TP axis); optimizer states of the same names are held by the
# sharding rank (`replica % sharding`) their index gives, model weights by every replica.
TENSORS = {"embed": (0, (64, 8), 0), "layers.0.norm": (0, (8,), None), "layers.0.w": (0, (8, 24), 1),
           "layers.1.w": (1, (24, 8), 0), "layers.1.norm": (1, (8,), None), "head": (1, (8, 64), 1)}
F32 = np.dtype("float32")


def _job(tp: int, pp: int, replicas: int, sharding: int, stage3: bool) -> dict:
    """Every rank's holdings of a job of `replicas` weight replicas (data x sharding) per stage."""
    ranks = {}
    for stage in range(pp):
        for replica in range(replicas):
            for tp_rank in range(tp):
                held = {}
                for kind in (MODEL, OPTIMIZER):
                    held[kind] = {}
                    for index, (name, (at, shape, axis)) in enumerate(TENSORS.items()):
                        if at % pp != stage or (kind == OPTIMIZER and not stage3 and index % sharding
                                                != replica % sharding):
                            continue
                        piece = Piece(axis, tp, tp_rank)
                        sliced = stage3 and len(shape) > 1
                        if sliced:
                            width = -(-int(np.prod(piece.local_shape(shape))) // sharding)
                            piece = Piece(axis, tp, tp_rank, FlatRange(replica % sharding, sharding, width))
                        held[kind][f"{kind}:{name}"] = Holding(TensorSpec(f"{kind}:{name}", F32, shape), piece)
                ranks[(stage, replica, tp_rank)] = held
    return ranks


def _report(slot, rank: int, held: dict, tp: int) -> dict:
    return {"rank": rank, "stage": slot[0], "replica": slot[1], "tp_rank": slot[2], "tensors": holding_sizes(held, tp)}


@pytest.mark.parametrize("tp, pp, replicas, sharding, stage3", [
    (2, 2, 2, 2, False),  # tp2 x pp2 x sharding2 stage1: optimizer states held by one replica each
    (2, 1, 4, 2, True),  # tp2 x dp2 x sharding2 stage3: flat slices gathered to the writer's replica
    (1, 2, 2, 1, False),  # pp2 x dp2: no TP pieces
], ids=["tp2-pp2-stage1", "tp2-dp2-stage3", "pp2-dp2"])
def test_every_tensor_is_written_once_whole_or_as_all_its_pieces_in_its_writers_file(tp, pp, replicas, sharding,
                                                                                     stage3):
    ranks = _job(tp, pp, replicas, sharding, stage3)
    reports = [_report(slot, number, held, tp) for number, (slot, held) in enumerate(sorted(ranks.items()))]
    plan = assign_writers(items_from_holdings(reports), tp)
    files = writer_files(plan, reports, [MODEL, OPTIMIZER])
    tasks = {(kind, slot): save_tasks(kind, held[kind], plan, files[kind], slot, tp, sharding)
             for slot, held in ranks.items() for kind in (MODEL, OPTIMIZER)}

    layouts = {t.fname: (shard_layout(list(t.specs), SHARD_METADATA), t) for t in tasks.values() if t.fname}
    whole, pieces = defaultdict(list), defaultdict(set)
    for (kind, slot), mine in tasks.items():
        assert (mine.fname is not None) == (slot in files[kind])
        for task in mine.tasks:
            if task.action == WHOLE_INTO_OWN_FILE:
                assert task.name in {s.name for s in mine.specs} - mine.holes
                whole[task.name].append(mine.fname)
            elif task.action == PIECE_IN_PLACE:
                (starts, size), owner = layouts[task.place.fname]
                assert task.name in owner.holes, "a piece goes only into a hole its writer left"
                assert (task.place.offset, task.place.file_size) == (starts[task.name], size)
                assert task.piece.part == slot[2] and task.piece.split
                pieces[task.name].add((task.place.fname, task.piece.part))
    every = {name for held in ranks.values() for kind in held for name in held[kind]}
    for name in every:
        kind, base = name.split(":")
        writer = plan.writer[(kind, name)]
        if TENSORS[base][2] is not None and tp > 1:
            assert name not in whole and pieces[name] == {(files[kind][writer], part) for part in range(tp)}, name
        else:
            assert whole[name] == [files[kind][writer]] and name not in pieces, name
    for fname, ((starts, _), owner) in layouts.items():  # every spec of a file is written by someone
        assert set(starts) == {n for n in whole if fname in whole[n]} | {n for n in pieces
                                                                          if any(f == fname for f, _ in pieces[n])}


def test_stage3_gathers_pair_up_over_the_sharding_group():
    """Each sharding group's members take part in the same gathers, in the same order, to the same
    root; the root writes what it gathers and every other member only sends."""
    tp, sharding = 2, 2
    ranks = _job(tp, 1, 4, sharding, stage3=True)
    reports = [_report(slot, number, held, tp) for number, (slot, held) in enumerate(sorted(ranks.items()))]
    plan = assign_writers(items_from_holdings(reports), tp)
    files = writer_files(plan, reports, [MODEL, OPTIMIZER])
    gathered = set()
    for kind in (MODEL, OPTIMIZER):
        for group in range(4 // sharding):
            for tp_rank in range(tp):
                members = [(0, group * sharding + s, tp_rank) for s in range(sharding)]
                gathers = [[(t.name, t.slice_root) for t in save_tasks(kind, ranks[m][kind], plan, files[kind], m, tp,
                                                                       sharding).tasks if t.piece.flat is not None]
                           for m in members]
                assert all(g == gathers[0] for g in gathers), (kind, group, tp_rank)
                gathered |= {name for name, _ in gathers[0]}
                for member in members:
                    for task in save_tasks(kind, ranks[member][kind], plan, files[kind], member, tp, sharding).tasks:
                        if task.piece.flat is not None:
                            root = task.slice_root == member[1] % sharding
                            assert (task.action != SEND_SLICE) == root, (kind, member, task.name)
    assert gathered == {name for held in ranks.values() for kind in held for name, h in held[kind].items()
                        if h.piece.flat is not None}, "every sliced tensor is gathered by some group"
