"""Tensors that must be equal on every replica, compared by checksum before a save writes them.

The unified checkpoint writes each tensor once, from one replica, so a replica that drifted (fleet
re-syncs TP-replicated parameters only for a few name patterns; on GPU an RMSNorm weight can drift
between TP ranks) would make the checkpoint depend on which rank wrote. Every rank fingerprints each
of its parameters (no gather of the tensors); ranks that hold the same piece of a parameter (every
TP rank for a replicated one, every data-parallel and sharding copy, both pipeline stages of a tied
one) must agree. The fingerprint is the wrapping 64-bit sum of the tensor's 8-byte words: any
changed value changes it, and it runs at memory speed (16 GB/s against CRC-32's 3 GB/s here, which
cost 7% of a save; bench/replica_check.py). It does not see values swapped between positions, which
drift does not produce.
"""

from __future__ import annotations

import warnings

import numpy as np
import paddle

from checkpoint.format import CheckpointError
from checkpoint.stage3 import FlatSlice, held_piece
from paddle_pp.runtime.topology import Topology, gather_objects

REPLICA_CHECKS = ("error", "warn")


class ReplicaMismatchError(CheckpointError):
    """Copies of a tensor that must be identical differ between ranks."""


def host_array(tensor: paddle.Tensor, cast: str | None, borrow: bool) -> np.ndarray:
    """The tensor on the host, cast only when the dtype differs (a same-dtype cast would copy twice).
    With `borrow`, a CPU tensor is returned as a zero-copy view: a synchronous save writes it before
    training can change it, and copying costs as much as writing (1.2 s of a 3.6 s save of 2 GB).
    numpy has no bfloat16, so those are copied as their uint16 bits."""
    if cast and str(tensor.dtype).removeprefix("paddle.") != cast:
        tensor = tensor.astype(cast)
    if borrow and tensor.place.is_cpu_place() and tensor.dtype != paddle.bfloat16:
        return np.from_dlpack(tensor)
    return tensor.numpy()


def fingerprint(array: np.ndarray) -> int:
    """The wrapping 64-bit sum of the array's bytes read as little-endian 8-byte words (the last
    word zero-padded)."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    whole = raw.size // 8 * 8
    tail = int.from_bytes(raw[whole:].tobytes(), "little")
    return (int(raw[:whole].view("<u8").sum(dtype=np.uint64)) + tail) % 2**64


def replica_fingerprints(state: dict, axes: dict, topo: Topology) -> dict[str, tuple[str | None, int]]:
    """name -> (the piece this rank holds: its TP piece and stage3 slice, None when it holds the
    whole tensor; the piece's fingerprint)."""
    sums = {}
    for name, tensor in state.items():
        piece = held_piece(tensor, axes.get(name), topo)
        storage = tensor.storage if isinstance(tensor, FlatSlice) else tensor
        sums[name] = (piece.describe(), fingerprint(host_array(storage.detach(), None, borrow=True)))
    return sums


def replica_mismatches(reports: list[dict[str, tuple[str | None, int]]]) -> list[str]:
    """One line per (tensor, piece) whose ranks disagree, naming the ranks of each fingerprint."""
    holders: dict[tuple[str, str | None], dict[int, list[int]]] = {}
    for rank, sums in enumerate(reports):
        for name, (piece, value) in sums.items():
            holders.setdefault((name, piece), {}).setdefault(value, []).append(rank)
    return [f"{name}{'' if piece is None else f' ({piece})'}: "
            + " vs ".join(f"ranks {ranks} hold fingerprint {value:016x}"
                          for value, ranks in sorted(by_value.items(), key=lambda kv: kv[1]))
            for (name, piece), by_value in sorted(holders.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
            if len(by_value) > 1]


def check_replicas(state: dict, axes: dict, topo: Topology, mode: str) -> None:
    """Compare every parameter's copies across the job (one all-gather of fingerprints)."""
    judge_replicas(gather_objects(replica_fingerprints(state, axes, topo), None, topo.layout.world_size), mode)


def judge_replicas(reports: list[dict[str, tuple[str | None, int]]], mode: str) -> None:
    """Every rank's fingerprints, judged the same way on every rank. On a mismatch, `mode` "error"
    raises on every rank before anything is written; "warn" warns and lets the save go on (the copy
    of the rank that writes it is saved)."""
    if mode not in REPLICA_CHECKS:
        raise ValueError(f"replica check {mode!r} is not one of {REPLICA_CHECKS}")
    problems = replica_mismatches(reports)
    if not problems:
        return
    message = (f"{len(problems)} tensor(s) differ between replicas that must hold the same values: "
               + "; ".join(problems[:5]))
    if mode == "error":
        raise ReplicaMismatchError(message + ". The save was not written and `latest` is unchanged; resume from "
                                   "it, or save anyway with --replica_check warn")
    warnings.warn(message, stacklevel=2)
