"""Offline check of a checkpoint folder: every file present, unaltered, and consistent."""

from __future__ import annotations

from pathlib import Path

from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR, CheckpointError, index_name, read_index
from checkpoint.shards import ShardReader, file_sha256


def verify_checkpoint(folder: Path) -> list[str]:
    """Problems found (empty when the checkpoint is sound): missing or altered files, tensors the
    index lists but a shard lacks, optimizer states of parameters the model does not have."""
    folder = Path(folder)
    problems: list[str] = []
    model_names: set[str] = set()
    for kind in (MODEL, OPTIMIZER):
        if kind == OPTIMIZER and not (folder / index_name(kind)).is_file():
            continue
        try:
            index = read_index(folder, kind)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        meta = index["metadata"]
        for fname, expected in sorted(meta["files"].items()):
            path = folder / fname
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            if path.stat().st_size != expected["size"]:
                problems.append(f"{path}: {path.stat().st_size} bytes, index says {expected['size']} (truncated)")
                continue
            if file_sha256(path) != expected["sha256"]:
                problems.append(f"{path}: SHA-256 mismatch (corrupted)")
                continue
            try:
                held = ShardReader(path).names
            except CheckpointError as err:
                problems.append(str(err))
                continue
            listed = {n for n, f in index["weight_map"].items() if f == fname}
            if listed - held:
                problems.append(f"{path}: lacks {sorted(listed - held)[:3]} listed in {index_name(kind)}")
        names = set(index["weight_map"])
        if kind == MODEL:
            model_names = names
        else:
            orphans = sorted({n.split(STATE_SEPARATOR)[0] for n in names} - model_names)
            if orphans:
                problems.append(f"optimizer states for parameters the model lacks: {orphans[:3]}")
    return problems
