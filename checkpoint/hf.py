"""Hugging Face transformers layout: export a unified checkpoint, import one back.

Names and config fields map through the family's `TransformersNames` (LLaMA has one); transformers
stores linear weights as [out, in] (torch) where Paddle stores [in, out], so every weight the TP plan
marks `linear` is transposed. LLaMA's rotary layout (half rotation) is the same in both, so no
permutation is needed. Tensors stream one at a time, into a folder that appears only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import new_folder
from checkpoint.format import CONFIG_FILE, MODEL, CheckpointError, copy_tokenizer_files
from checkpoint.shards import ShardReader, TensorSpec, pack, write_shard
from checkpoint.unified_io import UnifiedReader
from modeling.family import ModelFamily
from modeling.registry import config_from_dict, family, plan_of

HF_INDEX = "model.safetensors.index.json"


def _transformers_family(config: dict, folder: Path) -> ModelFamily:
    model_family = family(config.get("model_type"))
    if model_family.transformers is None:
        raise CheckpointError(f"{folder} holds a {model_family.model_type!r} model, which has no transformers "
                              "name mapping yet; only families with one (LLaMA) convert")
    return model_family


def _hf_config(model_family: ModelFamily, config: dict, dtype: str = "float32") -> dict:
    names = model_family.transformers
    return {"architectures": [model_family.architecture], "model_type": model_family.model_type,
            "torch_dtype": dtype, **names.fixed_config, **{k: config[k] for k in names.config_keys if k in config}}


def _stream_copy(names: list[str], shape_of: Callable[[str], list[int]], read: Callable[[str], np.ndarray],
                 rename: Callable[[str], str], transposed: Callable[[str], bool], target: Path, max_shard_bytes: int,
                 fmt: str, dtype: str = "float32") -> dict:
    """Write `names` (renamed, linear ones transposed, cast to `dtype`) into shards; returns the HF weight map."""
    itemsize = np.dtype(dtype).itemsize
    groups = pack(names, lambda name: int(np.prod(shape_of(name))) * itemsize, max_shard_bytes)
    weight_map = {}
    for number, group in enumerate(groups, start=1):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        shapes = [tuple(reversed(shape_of(n))) if transposed(n) else tuple(shape_of(n)) for n in group]
        specs = [TensorSpec(rename(n), np.dtype(dtype), s) for n, s in zip(group, shapes)]
        order = sorted(range(len(group)), key=lambda k: specs[k].name)
        write_shard(target / fname, [specs[k] for k in order],
                    (np.ascontiguousarray(read(group[k]).T if transposed(group[k]) else read(group[k]))
                     .astype(dtype) for k in order), {"format": fmt})
        weight_map |= {specs[k].name: fname for k in order}
    return weight_map


def export_hf(folder: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None, dtype: str = "float32") -> Path:
    """A transformers-loadable folder (config.json, model.safetensors[ + index], tokenizer) from a
    unified checkpoint, its weights in `dtype` (shards.EXPORT_DTYPES)."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    model_family = _transformers_family(config, folder)
    plan = plan_of(config_from_dict(config))
    unified = UnifiedReader(folder, MODEL)
    with new_folder(target) as partial:
        weight_map = _stream_copy(sorted(unified.tensors), lambda n: unified.tensors[n]["shape"],
                                  lambda n: _reported(n, unified.read(n), on_tensor), model_family.transformers.to_hf,
                                  lambda n: plan[n].linear, partial, max_shard_bytes, "pt", dtype)
        _finish(partial, weight_map, _hf_config(model_family, config, dtype), folder)
    return Path(target)


def import_hf(source: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A single-card Paddle folder (our names, [in, out] linears) from a transformers one;
    `config.json` keeps the fields both share, so `config_from_dict` builds our config."""
    source = Path(source)
    config = json.loads((source / CONFIG_FILE).read_text())
    model_family = _transformers_family(config, source)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{source} holds no .safetensors weights")
    readers = {f: ShardReader(f) for f in files}
    where = {name: f for f, reader in readers.items() for name in reader.names}
    ours = {k: v for k, v in _hf_config(model_family, config).items()
            if k in model_family.transformers.config_keys or k == "model_type"}
    plan = plan_of(config_from_dict(ours))
    from_hf = model_family.transformers.from_hf
    unknown = sorted(name for name in where if from_hf(name) not in plan)
    if unknown:
        raise CheckpointError(f"{source} holds tensors {unknown[:3]} that {model_family.architecture} does not have")
    with new_folder(target) as partial:
        weight_map = _stream_copy(sorted(where), lambda n: readers[where[n]].shape(n),
                                  lambda n: _reported(n, readers[where[n]].read(n), on_tensor), from_hf,
                                  lambda n: plan[from_hf(n)].linear, partial, max_shard_bytes, "np")
        _finish(partial, weight_map, ours, source)
    return Path(target)


def _reported(name: str, array: np.ndarray, on_tensor: Callable[[str, int], None] | None) -> np.ndarray:
    if on_tensor:
        on_tensor(name, array.nbytes)
    return array


def _finish(target: Path, weight_map: dict, config: dict, source: Path) -> None:
    files = sorted(set(weight_map.values()))
    if len(files) > 1:
        total = sum((target / f).stat().st_size for f in files)
        (target / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True))
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    copy_tokenizer_files(source, target)
