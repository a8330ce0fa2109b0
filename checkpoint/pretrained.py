"""Initial weights from a model folder (`--model_name_or_path`): our unified checkpoint, a
PaddleNLP `save_pretrained` folder (safetensors or pdparams, sharded or not), or a transformers
LLaMA folder, read in place under any layout.

`open_pretrained` runs before any process group: it recognises the folder, turns its config.json
into ours, and checks every tensor's name and shape against the family's TP plan from the file
headers, so a wrong folder fails on every rank with the same message. `load_pretrained` then has
each rank read only its TP slices (positioned reads; transformers' [out, in] linears are sliced
along the other axis and transposed), as a resume does.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.format import CONFIG_FILE, MODEL, CheckpointError, index_name
from checkpoint.load import (
    LOAD_ERRORS, agree_on_outcome, checkpoint_error, load_checkpoint, set_parameter,
)
from checkpoint.shards import ShardReader
from checkpoint.unified_io import UnifiedReader
from modeling.registry import FAMILIES, config_from_dict, family, plan_of
from modeling.tp_plan import split_tensor
from paddle_pp.runtime.topology import Topology

UNIFIED, PADDLENLP, TRANSFORMERS = "paddle-pp unified checkpoint", "PaddleNLP", "transformers"
PDPARAMS, PDPARAMS_INDEX = "model_state.pdparams", "model_state.pdparams.index.json"
HF_INDEX = index_name(MODEL)  # transformers and PaddleNLP name their sharded safetensors index like ours
LAYOUT_FIELDS = ("self", "kwargs", "recompute", "virtual_pp_degree")  # set by the run, not by the folder
IGNORED_BUFFERS = ("rotary_emb.inv_freq",)  # older transformers folders store this buffer; it is recomputed


@dataclass
class PretrainedFolder:
    """A recognised model folder: its kind, our config for it, and a reader of single-card tensors."""

    folder: Path
    kind: str
    config: dict
    read: Callable[[str, int | None, int, int], np.ndarray] = field(repr=False)  # (name, axis, parts, part)


def open_pretrained(folder: Path, weights: bool = True) -> PretrainedFolder:
    """The folder recognised and checked (config, every tensor name and shape from file headers)
    without reading weights. `weights` False (a run that resumes its own checkpoint, or takes only
    the config): pickled pdparams, which have no headers, are not loaded just to be checked."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"--model_name_or_path {folder}: no {CONFIG_FILE} there; pass a folder saved by "
                              "paddle-pp, PaddleNLP's save_pretrained or transformers' save_pretrained")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    if _is_unified(folder):
        unified = UnifiedReader(folder, MODEL)
        config = {"model_type": raw.get("model_type"), **_config_fields(raw)}
        shapes = {name: meta["shape"] for name, meta in unified.tensors.items()}
        return _checked(folder, UNIFIED, config, shapes, unified.read, lambda name: name, lambda name: False)
    config = _our_config(folder, raw)
    plan = plan_of(config_from_dict(config))
    if (folder / PDPARAMS).is_file() or (folder / PDPARAMS_INDEX).is_file():
        if not weights:
            return PretrainedFolder(folder, PADDLENLP, config, read=_not_loaded)
        arrays = _pdparams(folder)
        return _checked(folder, PADDLENLP, config, {name: list(a.shape) for name, a in arrays.items()},
                        lambda key, axis, parts, part: split_tensor(arrays[key], axis, parts, part),
                        lambda name: name, lambda name: False)
    readers = {name: reader for reader in map(ShardReader, _safetensors_files(folder)) for name in reader.names}
    shapes = {name: reader.shape(name) for name, reader in readers.items()}
    read = lambda key, axis, parts, part: readers[key].read(key, axis, parts, part)  # noqa: E731
    if any(name.startswith("model.") for name in readers):
        return _checked(folder, TRANSFORMERS, config, shapes, read, family(config["model_type"]).transformers.to_hf,
                        lambda name: plan[name].linear)
    return _checked(folder, PADDLENLP, config, shapes, read, lambda name: name, lambda name: False)


def _not_loaded(name: str, *_piece) -> np.ndarray:
    raise CheckpointError(f"{name}: the folder was opened for its config only (open_pretrained(weights=False))")


def _is_unified(folder: Path) -> bool:
    index = folder / HF_INDEX
    return index.is_file() and "format_version" in json.loads(index.read_text()).get("metadata", {})


def _config_fields(raw: dict) -> dict:
    """The fields of a config.json the family's config class takes (PaddleNLP's and transformers'
    configs carry many more: generation defaults, layout, kernel choices); None means unset."""
    accepted = inspect.signature(family(raw.get("model_type")).config_class.__init__).parameters
    return {k: raw[k] for k in accepted if k not in LAYOUT_FIELDS and raw.get(k) is not None}


def _safetensors_files(folder: Path) -> list[Path]:
    if (folder / HF_INDEX).is_file():
        weight_map = json.loads((folder / HF_INDEX).read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"--model_name_or_path {folder}: no weights found (model.safetensors[.index.json], "
                              f"{PDPARAMS} or {PDPARAMS_INDEX})")
    return files


def _pdparams(folder: Path) -> dict[str, np.ndarray]:
    """PaddleNLP's pickled weights, loaded whole (the format has no positioned reads, so each rank
    holds the whole state while it loads: prefer safetensors for large models)."""
    import paddle

    if (folder / PDPARAMS_INDEX).is_file():
        files = sorted(set(json.loads((folder / PDPARAMS_INDEX).read_text())["weight_map"].values()))
    else:
        files = [PDPARAMS]
    state: dict[str, np.ndarray] = {}
    for fname in files:
        if not (folder / fname).is_file():
            raise CheckpointError(f"{folder / fname} is missing (listed in {PDPARAMS_INDEX})")
        state |= {k: np.asarray(v) for k, v in paddle.load(str(folder / fname), return_numpy=True).items()}
    return state


def _checked(folder: Path, kind: str, config: dict, shapes: dict[str, list[int]], read_stored: Callable,
             stored_name: Callable[[str], str], transposed: Callable[[str], bool]) -> PretrainedFolder:
    """The folder's reader under our names, after every planned tensor is found in its single-card
    shape and no stored tensor is left over."""
    plan = plan_of(config_from_dict(config))
    problems = []
    for name, row in sorted(plan.items()):
        key = stored_name(name)
        if key not in shapes:
            problems.append(f"{key}: missing")
        elif list(shapes[key])[:: -1 if transposed(name) else 1] != list(row.shape):
            problems.append(f"{key}: shape {list(shapes[key])} in the folder, the model needs "
                            f"{list(row.shape)[:: -1 if transposed(name) else 1]}")
    planned = {stored_name(name) for name in plan}
    problems += [f"{key}: not a tensor of {config['model_type']}" for key in sorted(shapes)
                 if key not in planned and not key.endswith(IGNORED_BUFFERS)]
    if problems:
        raise CheckpointError(f"--model_name_or_path {folder} ({kind}) does not match the model its config.json "
                              "describes: " + "; ".join(problems[:6])
                              + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))

    def read(name: str, axis: int | None, parts: int, part: int) -> np.ndarray:
        flip = transposed(name)
        piece = read_stored(stored_name(name), None if axis is None else (1 - axis if flip else axis), parts, part)
        return piece.T if flip else piece

    return PretrainedFolder(folder, kind, config, read)


def _our_config(folder: Path, raw: dict) -> dict:
    """config.json of a PaddleNLP or transformers folder as our config; anything that changes the
    network in a way our families do not model is refused by name."""
    model_type = raw.get("model_type")
    model_family = FAMILIES.get(model_type)
    if model_family is None or model_family.transformers is None:
        supported = sorted(name for name, fam in FAMILIES.items() if fam.transformers is not None)
        raise CheckpointError(f"--model_name_or_path {folder}: model_type {model_type!r} "
                              f"({raw.get('architectures')}) is not supported from PaddleNLP or transformers folders; "
                              f"supported: {supported} (other families load from paddle-pp checkpoints)")
    unsupported = {
        "hidden_act": raw.get("hidden_act", "silu") != "silu",
        "rope_scaling": bool(raw.get("rope_scaling")) or bool(raw.get("rope_scaling_type")),
        "rope_scaling_factor": raw.get("rope_scaling_factor", 1.0) != 1.0,
        "attention_bias": bool(raw.get("attention_bias")),
        "mlp_bias": bool(raw.get("mlp_bias")),
        "head_dim": raw.get("head_dim") not in (None, raw["hidden_size"] // raw["num_attention_heads"]),
        "fuse_attention_qkv": bool(raw.get("fuse_attention_qkv")),
        "fuse_attention_ffn": bool(raw.get("fuse_attention_ffn")),
    }
    refused = [f"{key}={raw.get(key)!r}" for key, bad in unsupported.items() if bad]
    if refused:
        raise CheckpointError(f"--model_name_or_path {folder}: config.json sets {', '.join(refused)}, which "
                              f"paddle-pp's {model_type} does not model; only the plain architecture loads")
    return {"model_type": model_type, **_config_fields(raw)}


def load_pretrained(pretrained: PretrainedFolder, model, axes: dict, topo: Topology | None) -> None:
    """Fill `model`'s parameters (this rank's TP slices) from the folder; a failure on any rank
    fails every rank. `topo` None: one process, single card (tools)."""
    if pretrained.kind == UNIFIED and topo is not None:
        load_checkpoint(pretrained.folder, model, None, topo, axes)  # with its checksums, spread over the ranks
        return
    tp, tp_rank = (topo.layout.tp, topo.tp_rank) if topo is not None else (1, 0)
    try:
        for name, param in model.state_dict().items():
            axis = axes.get(name) if tp > 1 else None
            set_parameter(param, pretrained.read(name, axis, tp, tp_rank))
        outcome = None
    except LOAD_ERRORS as err:
        outcome = checkpoint_error(err)
    if topo is not None:
        agree_on_outcome(outcome, pretrained.folder, topo)
    elif outcome is not None:
        raise outcome
