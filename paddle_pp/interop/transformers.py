"""Hugging Face transformers layout: export a unified checkpoint, import a transformers folder; and
the export to PaddleNLP's fused-projection layout, which shares the machinery.

Names, transposes, fused tensors and config fields come from the family's `TransformersAdapter`
(transformers stores linear weights [out, in] where Paddle stores [in, out]; GPT-2 fuses q, k and v
into one `c_attn`). The rotary layout (half rotation) is the same in both, so no permutation is
needed. Tensors stream one at a time, into a folder that appears only when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import new_folder
from checkpoint.format import (
    CONFIG_FILE,
    MODEL,
    CheckpointError,
    copy_tokenizer_files,
    read_index,
    require_our_layout,
)
from checkpoint.shards import TensorSpec, pack, write_shard
from checkpoint.unified_io import UnifiedReader
from modeling.family import ModelFamily
from modeling.paddlenlp_fused import fused_stored
from modeling.placement import ModelPlan, TensorPlan
from modeling.registry import config_from_dict, family, plan_of
from modeling.transformers_adapter import Stored, join
from paddle_pp.interop.carried import CARRIED_TENSORS, Carried, carried_in
from paddle_pp.interop.pretrained import open_pretrained, stored_shape

HF_INDEX = "model.safetensors.index.json"

Group = list[tuple[str, int]]  # our names making up one stored tensor, with their part index


def _transformers_family(config: dict, folder: Path) -> ModelFamily:
    model_family = family(config.get("model_type"))
    if model_family.transformers is None:
        raise CheckpointError(f"{folder} holds a {model_family.model_type!r} model, which has no transformers "
                              "mapping")
    return model_family


def write_model_shards(groups: dict[str, Group], shape_of: Callable[[str], list[int]], read: Callable[[str], np.ndarray],
                  target: Path, max_shard_bytes: int, fmt: str, dtype: str) -> dict:
    """Write each stored tensor (`groups`: stored name -> our parts, concatenated along their axis
    when several) as `dtype` into shards; returns the weight map."""
    itemsize = np.dtype(dtype).itemsize
    files = pack(sorted(groups), lambda name: int(np.prod(shape_of(name))) * itemsize, max_shard_bytes)
    weight_map = {}
    for number, names in enumerate(files, start=1):
        fname = "model.safetensors" if len(files) == 1 else f"model-{number:05d}-of-{len(files):05d}.safetensors"
        specs = [TensorSpec(name, np.dtype(dtype), tuple(shape_of(name))) for name in names]
        write_shard(target / fname, specs, (np.asarray(read(name), order="C").astype(dtype) for name in names),
                    {"format": fmt})
        weight_map |= dict.fromkeys(names, fname)
    return weight_map


class StoredTensors:
    """The tensors a folder stores for a model (`locate`: names, transposes, fused tensors; `copies`:
    stored names that repeat one of ours, as stored), each made on demand from our single-card tensors
    (`read`): shared by the exports and by checkpoints saved in transformers' layout
    (`transformers_layout`)."""

    def __init__(self, plan: ModelPlan, locate: Callable[[str, TensorPlan], Stored],
                 copies: dict[str, str] | None = None):
        self.plan, self.locate = plan, locate
        self.groups: dict[str, Group] = {}
        for name, row in plan.items():
            self.groups.setdefault(locate(name, row).name, []).append((name, locate(name, row).part))
        for copy, name in (copies or {}).items():
            self.groups[copy] = self.groups[locate(name, plan[name]).name]

    def shape(self, stored_name: str) -> list[int]:
        name = self.groups[stored_name][0][0]
        return stored_shape(self.plan[name].shape, self.locate(name, self.plan[name]))

    def make(self, stored_name: str, read: Callable[[str], np.ndarray],
             on_tensor: Callable[[str, int], None] | None = None) -> np.ndarray:
        """The stored tensor `stored_name`, from our tensors as `read` gives them."""
        members = []
        for name, _ in self.groups[stored_name]:
            stored = self.locate(name, self.plan[name])
            members.append((stored, read(name).T if stored.transposed else read(name)))
            if on_tensor:
                on_tensor(name, members[-1][1].nbytes)
        return join(members)


def export_stored(folder: Path, target: Path, locate: Callable[[str, TensorPlan], Stored], folder_config: dict,
                  fmt: str, max_shard_bytes: int, on_tensor: Callable[[str, int], None] | None, dtype: str,
                  copies: dict[str, str] | None = None, carried: Carried | None = None, plan: ModelPlan | None = None,
                  read: Callable[[str], np.ndarray] | None = None) -> Path:
    """A folder of the tensors `locate` says where to store (names, transposes, fused tensors) and their
    `copies`, built from a unified checkpoint one stored tensor at a time, with `folder_config` as its
    config.json; with `carried`, the checkpoint's file of them beside, as it is. `plan` and `read`: the
    tensors written and how each is read (default: the checkpoint's, as saved; a LoRA merge passes its own)."""
    folder = Path(folder)
    stored = StoredTensors(plan or plan_of(config_from_dict(json.loads((folder / CONFIG_FILE).read_text()))),
                           locate, copies)
    read = read or UnifiedReader(folder, MODEL).read
    with new_folder(target) as partial:
        weight_map = write_model_shards(stored.groups, stored.shape,
                                        lambda name: stored.make(name, read, on_tensor), partial,
                                        max_shard_bytes, fmt, dtype)
        if carried is not None:
            shutil.copyfile(folder / CARRIED_TENSORS, partial / CARRIED_TENSORS)
            weight_map |= dict.fromkeys(carried.names, CARRIED_TENSORS)
        finish_folder(partial, weight_map, folder_config, folder)
    return Path(target)


def hf_locator(config, carried: Carried | None = None) -> Callable[[str, TensorPlan], Stored]:
    """Where a transformers folder of `config`'s family stores each tensor; with `carried`, inside the
    multimodal folder it came from."""
    adapter = family(config.model_type).transformers
    if carried is None:
        return lambda name, row: adapter.stored(name, row, config)
    return lambda name, row: carried.kind.stored(adapter.stored(name, row, config))


def hf_config(config, dtype: str, carried: Carried | None = None) -> dict:
    """transformers' config.json of `config` (in `dtype`); with `carried`, the multimodal one around it."""
    theirs = family(config.model_type).transformers.their_config(config, dtype)
    return theirs if carried is None else carried.their_config(theirs)


def export_hf(folder: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None, dtype: str = "float32") -> Path:
    """A transformers-loadable folder (config.json, model.safetensors[ + index], tokenizer) from a
    unified checkpoint, its weights in `dtype` (shards.EXPORT_DTYPES); a multimodal folder's language
    model as that folder, with the parts it carried."""
    require_our_layout(read_index(folder, MODEL), Path(folder))
    saved = json.loads((Path(folder) / CONFIG_FILE).read_text())
    if saved.get("lora"):
        raise CheckpointError(f"{folder} holds LoRA adapters beside its frozen weights: write them as a PEFT folder "
                              "(tools/lora.py peft) or merged into a transformers folder (tools/lora.py merge)")
    adapter, config = _transformers_family(saved, Path(folder)).transformers, config_from_dict(saved)
    carried = carried_in(folder)
    return export_stored(folder, target, hf_locator(config, carried), hf_config(config, dtype, carried), "pt",
                         max_shard_bytes, on_tensor, dtype, adapter.stored_copies(config), carried)


def export_paddlenlp_fused(folder: Path, target: Path, fused: frozenset[str], max_shard_bytes: int = 5 << 30,
                           on_tensor: Callable[[str, int], None] | None = None, dtype: str = "float32") -> Path:
    """A PaddleNLP save_pretrained-style folder whose model fuses the projections `fused` names
    (fuse_attention_qkv, fuse_attention_ffn), as PaddleNLP's own model with those flags stores them."""
    require_our_layout(read_index(folder, MODEL), Path(folder))
    saved = json.loads((Path(folder) / CONFIG_FILE).read_text())
    model_family = family(saved.get("model_type"))
    unknown = fused - model_family.paddlenlp_fused
    if unknown:
        raise CheckpointError(f"PaddleNLP's {model_family.architecture} has no {', '.join(sorted(unknown))}")
    config = config_from_dict(saved)
    return export_stored(folder, target, lambda name, row: fused_stored(name, row, config, fused),
                         {**saved, **dict.fromkeys(fused, True), "dtype": dtype}, "np", max_shard_bytes, on_tensor,
                         dtype)


def import_hf(source: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None, allow_unsafe_pickle: bool = False) -> Path:
    """A single-card safetensors folder (our names, [in, out] linears, float32) from a transformers or
    PaddleNLP one (pdparams included: the way to leave pickles behind), read as `--model_name_or_path`
    reads it (its config.json checked field by field)."""
    pretrained = open_pretrained(Path(source), allow_unsafe_pickle=allow_unsafe_pickle)
    config = config_from_dict(pretrained.config)
    plan = plan_of(config)

    def read(name: str) -> np.ndarray:
        array = pretrained.read(name, None, 1, 0).astype(np.float32)
        if on_tensor:
            on_tensor(name, array.nbytes)
        return array

    with new_folder(target) as partial:
        groups = {name: [(name, 0)] for name in plan}
        weight_map = write_model_shards(groups, lambda name: list(plan[name].shape), read, partial, max_shard_bytes,
                                        "np", "float32")
        finish_folder(partial, weight_map, pretrained.config, Path(source))
    return Path(target)


def finish_folder(target: Path, weight_map: dict, config: dict, source: Path) -> None:
    files = sorted(set(weight_map.values()))
    if len(files) > 1:
        total = sum((target / f).stat().st_size for f in files)
        (target / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True))
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    copy_tokenizer_files(source, target)
