"""Hugging Face transformers layout for LLaMA: export a unified checkpoint, import one back.

transformers stores linear weights as [out, in] (torch) where Paddle stores [in, out], so every
linear weight is transposed; names gain the `model.` prefix; the rotary layout (half rotation) is
the same in both, so no permutation is needed. Tensors stream one at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.commit import fsync_dir
from checkpoint.format import MODEL, CheckpointError
from checkpoint.reshard import UnifiedReader
from checkpoint.shards import ShardReader, TensorSpec, write_shard

LINEAR = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$")
HF_INDEX = "model.safetensors.index.json"


def to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name.removeprefix("llama.")


def from_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "llama." + name.removeprefix("model.")


def _hf_config(config: dict) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings", "initializer_range",
            "bos_token_id", "eos_token_id", "pad_token_id")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32", **{k: config[k] for k in keep if k in config}}


def _stream_copy(names: list[str], read, rename, transpose, target: Path, max_shard_bytes: int, fmt: str) -> dict:
    """Write `names` (renamed, linear ones transposed) into shards; returns the HF weight map."""
    groups, size = [[]], 0
    for name in names:
        shape = read(name, shape_only=True)
        nbytes = int(np.prod(shape)) * 4
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for number, group in enumerate(groups, start=1):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        shapes = [tuple(reversed(read(n, shape_only=True))) if transpose(n) else tuple(read(n, shape_only=True))
                  for n in group]
        specs = [TensorSpec(rename(n), np.dtype("float32"), s) for n, s in zip(group, shapes)]
        order = sorted(range(len(group)), key=lambda k: specs[k].name)
        write_shard(target / fname, [specs[k] for k in order],
                    (np.ascontiguousarray(read(group[k]).T if transpose(group[k]) else read(group[k]))
                     .astype(np.float32) for k in order), {"format": fmt})
        weight_map |= {specs[k].name: fname for k in order}
    return weight_map


def export_hf(folder: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A transformers-loadable folder (config.json, model.safetensors[ + index], tokenizer) from a
    unified LLaMA checkpoint."""
    folder, target = Path(folder), Path(target)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise CheckpointError(f"export to transformers supports LLaMA checkpoints; {folder} holds "
                              f"{config.get('model_type')!r}")
    unified = UnifiedReader(folder, MODEL)

    def read(name: str, shape_only: bool = False):
        return unified.tensors[name]["shape"] if shape_only else _reported(name, unified.read(name), on_tensor)

    target.mkdir(parents=True, exist_ok=False)
    weight_map = _stream_copy(sorted(unified.tensors), read, to_hf_name, lambda n: bool(LINEAR.search(n)),
                              target, max_shard_bytes, "pt")
    _finish(target, weight_map, _hf_config(config), folder)
    return target


def import_hf(source: Path, target: Path, max_shard_bytes: int = 5 << 30,
              on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A single-card Paddle LLaMA folder (our names, [in, out] linears) from a transformers one;
    `config.json` keeps the fields both share, so `config_from_dict` builds our LlamaConfig."""
    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise CheckpointError(f"import supports transformers LLaMA folders; {source} holds {config.get('model_type')!r}")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{source} holds no .safetensors weights")
    readers = {f: ShardReader(f) for f in files}
    where = {name: f for f, reader in readers.items() for name in reader.names}

    def read(name: str, shape_only: bool = False):
        reader = readers[where[name]]
        return reader.shape(name) if shape_only else _reported(name, reader.read(name), on_tensor)

    target.mkdir(parents=True, exist_ok=False)
    weight_map = _stream_copy(sorted(where), read, from_hf_name, lambda n: bool(LINEAR.search(from_hf_name(n))),
                              target, max_shard_bytes, "np")
    ours = {k: v for k, v in _hf_config(config).items() if k not in ("architectures", "hidden_act", "torch_dtype")}
    _finish(target, weight_map, ours, source)
    return target


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
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if (source / "tokenizer.model").is_file():
        shutil.copyfile(source / "tokenizer.model", target / "tokenizer.model")
    fsync_dir(target)
