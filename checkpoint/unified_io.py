"""Streaming a unified checkpoint in one process: read whole tensors or TP slices, write a kind's
shards and index, rewrite with another shard size (`rechunk`).

Every rewrite streams one tensor at a time, so peak memory is about the largest tensor, never the
model, and goes through `durable.new_folder`, so an interrupted tool leaves no folder that looks whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from checkpoint.durable import new_folder, write_json_durably
from checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    copy_tokenizer_files,
    index_name,
    read_index,
    require_our_layout,
    shard_name,
    tensor_nbytes,
)
from checkpoint.piece import WHOLE, Piece
from checkpoint.shards import ShardReader, TensorSpec, pack, write_shard


def reading(names: list[str], read: Callable[[str], np.ndarray],
            on_tensor: Callable[[str, int], None] | None) -> Iterator[np.ndarray]:
    """`read(name)` for each name in turn, reporting each tensor once it has been consumed."""
    for name in names:
        array = read(name)
        yield array
        if on_tensor:
            on_tensor(name, array.nbytes)


def write_unified_kind(folder: Path, kind: str, tensors: dict[str, dict], read: Callable[[str], np.ndarray],
                       metadata: dict, max_shard_bytes: int, on_tensor: Callable[[str, int], None] | None = None) -> None:
    """Write every tensor of `tensors` ({name: {dtype, shape, tp_axis}}) as unified shards of at most
    `max_shard_bytes`, fetching each with `read(name)` only when its turn comes, then the index with
    `metadata` completed by files and sizes."""
    groups = pack(sorted(tensors), lambda name: tensor_nbytes(tensors[name]), max_shard_bytes)
    files, weight_map = {}, {}
    for number, names in enumerate(groups, start=1):
        fname = shard_name(kind, number, len(groups))
        specs = [TensorSpec(n, np.dtype(tensors[n]["dtype"]), tuple(tensors[n]["shape"])) for n in names]
        files[fname] = write_shard(folder / fname, specs, reading(names, read, on_tensor), {"format": "np"})
        weight_map |= {n: fname for n in names}
    total = sum(tensor_nbytes(meta) for meta in tensors.values())
    write_json_durably(folder / index_name(kind), {
        "metadata": {**metadata, "format_version": FORMAT_VERSION, "total_size": total, "files": files,
                     "tensors": tensors},
        "weight_map": weight_map})


class UnifiedReader:
    """Whole tensors or TP slices of a unified checkpoint, one shard reader per file, opened on demand."""

    def __init__(self, folder: Path, kind: str):
        self.folder, self.index = Path(folder), read_index(folder, kind)
        require_our_layout(self.index, self.folder)
        self.tensors: dict[str, dict] = self.index["metadata"]["tensors"]
        self._readers: dict[str, ShardReader] = {}

    def read(self, name: str, piece: Piece = WHOLE) -> np.ndarray:
        fname = self.index["weight_map"][name]
        if fname not in self._readers:
            self._readers[fname] = ShardReader(self.folder / fname)
        return self._readers[fname].read(name, piece)

    def piece(self, name: str, parts: int, part: int) -> Piece:
        """Tensor `name`'s part for tp rank `part` of `parts`, by the TP axis its index records."""
        return Piece(self.tensors[name].get("tp_axis"), parts, part)


def rechunk(source: Path, target: Path, max_shard_bytes: int,
            on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Copy a checkpoint with shards of at most `max_shard_bytes`. Indexes, checksums and every other
    file follow; tensors are copied as they are."""
    source = Path(source)
    with new_folder(target) as partial:
        shutil.copytree(source, partial, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        for kind in (MODEL, OPTIMIZER):
            if (source / index_name(kind)).is_file():
                unified = UnifiedReader(source, kind)
                write_unified_kind(partial, kind, unified.tensors, unified.read, unified.index["metadata"],
                                   max_shard_bytes, on_tensor)
    return Path(target)


def export_weights(source: Path, target: Path, dtype: str = "float32", max_shard_bytes: int = 5 << 30,
                   on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A weights-only copy of a checkpoint to hand a model on: its model shards in `dtype`,
    config.json and tokenizer; no optimizer and no trainer state (so nobody resumes from it by
    mistake). The model index keeps the family and tied names."""
    source = Path(source)
    unified = UnifiedReader(source, MODEL)
    metadata = {k: v for k, v in unified.index["metadata"].items() if k in ("saving_layout", "model_type", "tied")}
    with new_folder(target) as partial:
        shutil.copyfile(source / CONFIG_FILE, partial / CONFIG_FILE)
        copy_tokenizer_files(source, partial)
        write_unified_kind(partial, MODEL, {n: {**meta, "dtype": dtype} for n, meta in unified.tensors.items()},
                           lambda n: unified.read(n).astype(dtype), metadata, max_shard_bytes, on_tensor)
    return Path(target)
