"""Offline layout work on unified checkpoints, in one process: plan a layout, change shard sizes.

`plan_layout` answers "will this layout run, and what does each rank hold?" from the config alone.
`rechunk` rewrites a checkpoint with another shard size, streaming one tensor at a time, so peak
memory is the largest tensor, never the model.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint.commit import fsync_dir
from checkpoint.format import MODEL, OPTIMIZER, CheckpointError, index_name, read_index, shard_name, write_json_durably
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


def _stages_of(name: str, config, layout: Layout, tied: set[str]) -> list[int]:
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
        for stage in _stages_of(name, config, layout, tied):
            counts[stage] += numel // layout.tp if axes.get(name) is not None else numel
    state_bytes = ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0)
    return [RankShare(stage, tp, int(n), int(n) * compute_bytes, int(n) * compute_bytes,
                      -(-int(n) * state_bytes // layout.sharding_degree))
            for (stage, tp), n in np.ndenumerate(counts)]


def rechunk(source: Path, target: Path, max_shard_bytes: int) -> Path:
    """Copy a checkpoint with shards of at most `max_shard_bytes` (one tensor larger than that gets
    a shard of its own). Indexes, checksums and every other file follow; tensors are copied as is."""
    source, target = Path(source), Path(target)
    if target.exists():
        raise CheckpointError(f"{target} exists; choose a new folder")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    for kind in (MODEL, OPTIMIZER):
        if not (source / index_name(kind)).is_file():
            continue
        index = read_index(source, kind)
        meta = index["metadata"]
        groups: list[list[str]] = [[]]
        size = 0
        for name in sorted(index["weight_map"]):
            nbytes = int(np.prod(meta["tensors"][name]["shape"], dtype=np.int64)) * np.dtype(meta["tensors"][name]["dtype"]).itemsize
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        readers: dict[str, ShardReader] = {}

        def read(name: str) -> np.ndarray:
            fname = index["weight_map"][name]
            readers.setdefault(fname, ShardReader(source / fname))
            return readers[fname].read(name)

        files, weight_map = {}, {}
        for number, names in enumerate(groups, start=1):
            fname = shard_name(kind, number, len(groups))
            specs = [TensorSpec(n, np.dtype(meta["tensors"][n]["dtype"]), tuple(meta["tensors"][n]["shape"]))
                     for n in names]
            sha, nbytes = write_shard(target / fname, specs, (read(n) for n in names), {"format": "np"})
            files[fname] = {"sha256": sha, "size": nbytes}
            weight_map |= {n: fname for n in names}
        write_json_durably(target / index_name(kind), {"metadata": {**meta, "files": files}, "weight_map": weight_map})
    fsync_dir(target)
    return target


def load_config(folder: Path):
    """The model config stored in a checkpoint folder."""
    from modeling import config_from_dict

    values = json.loads((Path(folder) / "config.json").read_text())
    values.pop("architectures", None)
    return config_from_dict(values)
