"""Offline layout work on unified checkpoints, in one process: plan a layout, change shard sizes.

`plan_layout` answers "will this layout run, and what does each rank hold?" from the config alone.
`rechunk` rewrites a checkpoint with another shard size. Every rewrite here streams one tensor at a
time, so peak memory is about the largest tensor, never the model, and writes into a `.partial`
folder renamed into place at the end, so an interrupted tool never leaves a folder that looks whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from checkpoint.commit import fsync_dir
from checkpoint.format import (
    FORMAT_VERSION, MODEL, OPTIMIZER, STATE_SEPARATOR, CheckpointError, index_name, read_index, shard_name,
    tensor_nbytes, write_json_durably,
)
from checkpoint.shards import ShardReader, TensorSpec, write_shard
from modeling import single_card_shapes, split_axes, tied_groups, validate_layout
from paddle_pp.layout import Layout

LAYER = re.compile(r"\.layers\.(\d+)\.")
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class RankShare:
    """What every rank at one (pipeline stage, tp rank) holds; dp and sharding ranks repeat it."""

    stage: int
    tp_rank: int
    parameters: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def stages_holding(name: str, config, layout: Layout, tied: set[str]) -> list[int]:
    """The pipeline stages whose model holds tensor `name` (an optimizer key goes with its parameter).

    Decoder layer i lives in virtual chunk i // (layers per chunk), and chunk c on stage c % pp;
    embeddings on the first stage, the rest (final norm, head) on the last; a tied tensor on both."""
    name = name.split(STATE_SEPARATOR)[0]
    match = LAYER.search(name)
    if match:
        chunk = int(match.group(1)) // (config.num_hidden_layers // (layout.pp * layout.vpp))
        return [chunk % layout.pp]
    first = name.endswith("embed_tokens.weight") or ".embeddings." in name
    return sorted({0, layout.pp - 1}) if name in tied else [0 if first else layout.pp - 1]


def plan_layout(config, layout: Layout, compute_bytes: int = 4) -> list[RankShare]:
    """Per (stage, tp rank): parameters and bytes of weights, grads and AdamW states (sharded over
    the sharding degree; plus fp32 master weights when compute is narrower than fp32). Activations
    depend on batch and sequence and are not included. Raises the layout's own errors when invalid."""
    validate_layout(config, layout)
    shapes, axes = single_card_shapes(config), split_axes(config)
    tied = {group[0] for group in tied_groups(config)}
    counts = np.zeros([layout.pp, layout.tp], dtype=np.int64)
    for name, shape in shapes.items():
        numel = int(np.prod(shape))
        for stage in stages_holding(name, config, layout, tied):
            counts[stage] += numel // layout.tp if axes.get(name) is not None else numel
    state_bytes = ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0)
    return [RankShare(stage, tp, int(n), int(n) * compute_bytes, int(n) * compute_bytes,
                      -(-int(n) * state_bytes // layout.sharding_degree))
            for (stage, tp), n in np.ndenumerate(counts)]


@contextmanager
def new_folder(target: Path) -> Iterator[Path]:
    """A folder written as `<target>.partial` and renamed to `target` only once complete."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"{target} exists; choose a new folder")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    fsync_dir(partial)
    os.replace(partial, target)
    fsync_dir(target.parent)


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
    `max_shard_bytes` (a larger tensor gets a shard of its own), fetching each with `read(name)`
    only when its turn comes, then the index with `metadata` completed by files and sizes."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensor_nbytes(tensors[name])
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
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
        self.tensors: dict[str, dict] = self.index["metadata"]["tensors"]
        self._readers: dict[str, ShardReader] = {}

    def read(self, name: str, axis: int | None = None, parts: int = 1, part: int = 0) -> np.ndarray:
        fname = self.index["weight_map"][name]
        if fname not in self._readers:
            self._readers[fname] = ShardReader(self.folder / fname)
        return self._readers[fname].read(name, axis, parts, part)


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


def load_config(folder: Path):
    """The model config stored in a checkpoint folder."""
    from modeling import config_from_dict

    values = json.loads((Path(folder) / "config.json").read_text())
    values.pop("architectures", None)
    return config_from_dict(values)
