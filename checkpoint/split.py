"""A per-rank pre-split copy of a unified checkpoint for one (tp, pp, vpp) layout, and back.

On file systems where thousands of ranks slicing the same unified files is slow, `split_checkpoint`
writes one file per (tp rank, pipeline stage) and kind, holding exactly that rank's tensors, so a
rank reads one file whole. The data-parallel and sharding degrees stay free: they do not change
what a (tp, pp) rank holds (a sharding rank loads the optimizer states it updates from its file).
`join_split` turns a split copy back into a unified checkpoint; the fleet merge goes through it.
Both stream one tensor at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import new_folder, write_json_durably
from checkpoint.format import (
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    CheckpointError,
    index_name,
    read_versioned_json,
)
from checkpoint.piece import Piece
from checkpoint.save_plan import tensor_stages
from checkpoint.shards import ShardReader, TensorSpec, write_shard
from checkpoint.unified_io import UnifiedReader, reading, write_unified_kind
from modeling.placement import ModelPlan
from paddle_pp.runtime.layout import Layout

SPLIT_INDEX = "split.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30
KINDS = (MODEL, OPTIMIZER)
TP_WHOLE = "tp_whole"  # the split index's tensors that have a tp axis but every rank of its degree holds whole


def rank_key(tp_rank: int, stage: int) -> str:
    return f"tp{tp_rank:02d}_pp{stage:02d}"


def rank_file(kind: str, tp_rank: int, stage: int) -> str:
    """PaddleNLP's per-rank suffix on a safetensors file: model.tp00_pp01.safetensors."""
    return f"{kind}.{rank_key(tp_rank, stage)}.safetensors"


def is_split(folder: Path) -> bool:
    return (Path(folder) / SPLIT_INDEX).is_file()


def read_split_index(folder: Path) -> dict:
    path = Path(folder) / SPLIT_INDEX
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {folder} is not a pre-split checkpoint")
    return read_versioned_json(path)


def split_degrees(index: dict) -> tuple[int, int, int]:
    layout = index["metadata"]["layout"]
    return layout["tensor_parallel_degree"], layout["pipeline_parallel_degree"], layout["virtual_pp_degree"]


def check_split_layout(folder: Path, layout: Layout) -> None:
    """Before any process group exists: a pre-split checkpoint fits only its own tp, pp and vpp."""
    saved = split_degrees(read_split_index(folder))
    if saved != (layout.tp, layout.pp, layout.vpp) or layout.dualpipev:
        v_shape = " (DualPipeV: its V places the stages otherwise)" if layout.dualpipev else ""
        raise CheckpointError(
            f"{folder} is pre-split for tp{saved[0]} pp{saved[1]} vpp{saved[2]}, this run is tp{layout.tp} "
            f"pp{layout.pp} vpp{layout.vpp}{v_shape}: resume from the unified checkpoint it was split from, or split "
            "that again for this layout (tools/reshard.py split)")


def split_layout(tp: int, pp: int, vpp: int) -> Layout:
    """The layout a split copy is for: its tp, pp and vpp (dp and sharding stay free)."""
    return Layout(world_size=tp * pp, tensor_parallel_degree=tp, pipeline_parallel_degree=pp, virtual_pp_degree=vpp,
                  device="cpu")


class SplitWriter:
    """Writes per-rank files into a folder and, at the end, the split index that lists them."""

    def __init__(self, folder: Path, layout: Layout):
        self.folder = Path(folder)
        self.layout = layout.record()
        self.files: dict[str, dict] = {}
        self.ranks: dict[str, dict[str, str]] = {}
        self.tensors: dict[str, dict[str, dict]] = {kind: {} for kind in KINDS}
        self.whole: set[str] = set()  # tensors with a tp axis that every rank of this degree holds whole

    def write(self, kind: str, tp_rank: int, stage: int, specs: list[TensorSpec], arrays, full: dict[str, dict]):
        """One rank's file of `kind`: `arrays` in `specs` order; `full` holds their unified metadata."""
        fname = rank_file(kind, tp_rank, stage)
        self.files[fname] = write_shard(self.folder / fname, specs, arrays, {"format": "np"})
        self.ranks.setdefault(rank_key(tp_rank, stage), {})[kind] = fname
        self.tensors[kind].update({spec.name: full[spec.name] for spec in specs})

    def finish(self, model_metadata: dict) -> None:
        write_json_durably(self.folder / SPLIT_INDEX, {
            "metadata": {"format_version": FORMAT_VERSION, "layout": self.layout, "files": self.files,
                         TP_WHOLE: sorted(self.whole), **model_metadata},
            "ranks": self.ranks, "tensors": {kind: t for kind, t in self.tensors.items() if t}})


def split_checkpoint(source: Path, target: Path, layout: Layout, plan: ModelPlan,
                     on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write `source` (unified) as per-rank files for `layout`'s tp, pp and vpp; `plan` is its model's,
    and the layout one the model fits (`modeling.registry.validate_layout`)."""
    source = Path(source)
    with new_folder(target) as partial:
        shutil.copytree(source, partial, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        writer = SplitWriter(partial, split_layout(layout.tp, layout.pp, layout.vpp))
        model_metadata = {}
        whole_parameters = plan.whole_at(layout.tp)
        for kind in KINDS:
            if not (source / index_name(kind)).is_file():
                continue
            unified = UnifiedReader(source, kind)
            if kind == MODEL:
                model_metadata = {k: unified.index["metadata"][k] for k in ("model_type", "tied")}
            whole = {n for n in unified.tensors if n.split(STATE_SEPARATOR)[0] in whole_parameters}
            writer.whole |= whole
            for stage in range(layout.pp):
                names = [n for n in sorted(unified.tensors) if stage in tensor_stages(plan, n, layout)]
                for tp_rank in range(layout.tp):
                    pieces = {n: Piece(unified.tensors[n].get("tp_axis")) if n in whole else
                              unified.piece(n, layout.tp, tp_rank) for n in names}
                    specs = [TensorSpec(n, np.dtype(unified.tensors[n]["dtype"]),
                                        tuple(pieces[n].local_shape(unified.tensors[n]["shape"]))) for n in names]
                    writer.write(kind, tp_rank, stage, specs,
                                 reading(names, lambda n: unified.read(n, pieces[n]), on_tensor), unified.tensors)
        writer.finish(model_metadata)
    return Path(target)


def join_split(source: Path, target: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write a split copy back as a unified checkpoint: each tensor from the lowest stage holding it,
    its tp pieces concatenated along its axis (a replicated tensor, or one the degree leaves whole, is
    taken from tp rank 0)."""
    source = Path(source)
    index = read_split_index(source)
    tp, pp, vpp = split_degrees(index)
    meta = index["metadata"]
    whole = set(meta.get(TP_WHOLE, ()))
    saving_layout = split_layout(tp, pp, vpp).record()
    with new_folder(target) as partial:
        shutil.copytree(source, partial, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", SPLIT_INDEX))
        for kind, tensors in index["tensors"].items():
            readers = {(t, s): ShardReader(source / index["ranks"][rank_key(t, s)][kind])
                       for t in range(tp) for s in range(pp) if kind in index["ranks"].get(rank_key(t, s), {})}
            first_stage = {}
            for (t, s), reader in sorted(readers.items(), key=lambda item: -item[0][1]):
                first_stage |= {name: s for name in reader.names}

            def read(name: str, tensors=tensors, readers=readers, first_stage=first_stage) -> np.ndarray:
                piece, stage = Piece(tensors[name].get("tp_axis"), 1 if name in whole else tp, 0), first_stage[name]
                if not piece.split:
                    return readers[(0, stage)].read(name)
                return np.concatenate([readers[(t, stage)].read(name) for t in range(tp)], axis=piece.axis)

            missing = sorted(set(tensors) - set(first_stage))
            if missing:
                raise CheckpointError(f"{source}: no rank file holds {missing[:3]}; the split copy is incomplete")
            extra = {k: meta[k] for k in ("model_type", "tied") if kind == MODEL and k in meta}
            write_unified_kind(partial, kind, tensors, read, {"saving_layout": saving_layout, **extra},
                               max_shard_bytes, on_tensor)
    return Path(target)
