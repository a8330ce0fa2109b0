"""A training checkpoint whose weights are a transformers folder as they stand (`--save_to_hf`,
PaddleFormers' name for the same choice): transformers' names and [out, in] linears in `format: pt`
files, transformers' config.json, the index transformers reads; the optimizer states, trainer state
and tokenizer beside them as in any checkpoint, so the folder also resumes under any layout.

The save writes the model's files in our layout as usual (`checkpoint.save`), then, before the
commit, every rank rewrites a share of them into transformers' tensors (`StoredTensors`: the export's
names, transposes and fused tensors), balanced by bytes; rank 0 swaps the files and the index. This
costs one more read and write of the model's weights, spread over the ranks, and keeps the save's
TP pieces, stage3 gathers and crash safety as they are: a failure anywhere leaves the save
uncommitted. Reading is `pretrained.open_pretrained`'s transformers path, with the index's checksums.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from checkpoint.durable import write_json_durably
from checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL,
    TRAINER_STATE_FILE,
    TRANSFORMERS_LAYOUT,
    WEIGHTS_LAYOUT,
    CheckpointError,
    foreign_checkpoint,
    index_name,
    read_index,
    tensor_nbytes,
    weights_layout,
)
from checkpoint.load import load_checkpoint
from checkpoint.shards import CHECKSUM, ShardReader, TensorSpec, file_checksum, file_entry, write_shard
from checkpoint.unified_io import UnifiedReader
from modeling.placement import ModelPlan
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.carried import CARRIED_TENSORS, Carried
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.interop.transformers import StoredTensors, hf_config, hf_locator
from paddle_pp.runtime.topology import Topology

REWRITTEN = ".transformers"  # the staged folder's subfolder the rewritten files are written into
DTYPE = np.dtype("float32")  # the model's weights are saved in fp32 in either layout


class TransformersWeights:
    """`checkpoint.save.ModelRewrite` into transformers' layout for `config`'s family; with `carried`,
    the multimodal folder around it (the carried tensors, which every save copies, listed beside)."""

    def __init__(self, config, carried: Carried | None = None):
        adapter = family_of(config).transformers  # every registered family has one
        self.stored = StoredTensors(plan_of(config), hf_locator(config, carried), adapter.stored_copies(config))
        self.config = hf_config(config, DTYPE.name, carried)
        self.carried = carried

    def shares(self, count: int) -> list[list[str]]:
        """The stored tensors cut into `count` shares of about equal bytes (largest first to the
        lightest share; the same on every rank), each share's names in order."""
        sizes = {name: int(np.prod(self.stored.shape(name))) * DTYPE.itemsize for name in self.stored.groups}
        shares: list[list[str]] = [[] for _ in range(count)]
        loads = [0] * count
        for name in sorted(sizes, key=lambda name: (-sizes[name], name)):
            lightest = min(range(count), key=lambda share: (loads[share], share))
            shares[lightest].append(name)
            loads[lightest] += sizes[name]
        return [sorted(names) for names in shares]

    def write_share(self, staged: Path, share: int, shares: int) -> dict:
        """Write this share's file of transformers' tensors, made from the staged model files."""
        cut = self.shares(shares)
        names = cut[share]
        if not names:
            return {}
        files = [index for index, names in enumerate(cut) if names]
        fname = f"model-{files.index(share) + 1:05d}-of-{len(files):05d}.safetensors"
        unified = UnifiedReader(staged, MODEL)
        specs = [TensorSpec(name, DTYPE, tuple(self.stored.shape(name))) for name in names]
        (staged / REWRITTEN).mkdir(exist_ok=True)
        entry = write_shard(staged / REWRITTEN / fname, specs,
                            (self.stored.make(name, unified.read).astype(DTYPE, copy=False) for name in names),
                            {"format": "pt"})
        return {"file": fname, "entry": entry,
                "tensors": {spec.name: {"dtype": DTYPE.name, "shape": list(spec.shape)} for spec in specs}}

    def replace(self, staged: Path, written: list[dict]) -> None:
        """The rewritten files in place of the staged model files, their index, transformers' config."""
        ours = read_index(staged, MODEL)
        for fname in ours["metadata"]["files"]:
            (staged / fname).unlink()
        files, tensors, weight_map = {}, {}, {}
        for share in filter(None, written):
            os.replace(staged / REWRITTEN / share["file"], staged / share["file"])
            files[share["file"]] = share["entry"]
            tensors |= share["tensors"]
            weight_map |= dict.fromkeys(share["tensors"], share["file"])
        shutil.rmtree(staged / REWRITTEN)
        if self.carried is not None:  # copied into the save beside the model's files
            files[CARRIED_TENSORS] = file_entry(file_checksum(staged / CARRIED_TENSORS, CHECKSUM),
                                                (staged / CARRIED_TENSORS).stat().st_size)
            reader = ShardReader(staged / CARRIED_TENSORS)
            tensors |= {name: {"dtype": reader.stored_dtype(name).name, "shape": reader.shape(name)}
                        for name in self.carried.names}
            weight_map |= dict.fromkeys(self.carried.names, CARRIED_TENSORS)
        kept = {key: value for key, value in ours["metadata"].items()
                if key in ("saving_layout", "model_type", "tied")}
        total = sum(tensor_nbytes(meta) for meta in tensors.values())
        write_json_durably(staged / index_name(MODEL), {
            "metadata": {**kept, "format_version": FORMAT_VERSION, WEIGHTS_LAYOUT: TRANSFORMERS_LAYOUT,
                         "total_size": total, "files": files, "tensors": tensors},
            "weight_map": weight_map})
        write_json_durably(staged / CONFIG_FILE, self.config)


def checkpoint_config(folder: Path) -> dict:
    """Our config of a checkpoint folder, in either weights layout (config.json is transformers' when
    it was saved with --save_to_hf), as `config.to_dict()` gives it."""
    folder = Path(folder)
    foreign = foreign_checkpoint(folder)
    if foreign:
        raise CheckpointError(foreign)
    if weights_layout(folder) is None:
        if not (folder / CONFIG_FILE).is_file():
            raise CheckpointError(f"{folder / CONFIG_FILE} is missing: {folder} is not a checkpoint of this trainer")
        return json.loads((folder / CONFIG_FILE).read_text())
    return config_from_dict(open_pretrained(folder, weights=False).config).to_dict()


def checkpoint_plan(folder: Path) -> ModelPlan:
    """The plan of the model a checkpoint folder holds, in either weights layout."""
    return plan_of(config_from_dict(checkpoint_config(folder)))


def load_resumed(folder: Path, model, axes: dict, topo: Topology) -> dict:
    """The weights of a checkpoint to resume, in either weights layout, and its trainer state."""
    if weights_layout(folder) is None:
        return load_checkpoint(folder, model, None, topo, axes)
    load_pretrained(open_pretrained(Path(folder)), model, axes, topo)
    return json.loads((Path(folder) / TRAINER_STATE_FILE).read_text())
