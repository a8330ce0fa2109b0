"""Initial weights from a model folder (`--model_name_or_path`): our unified checkpoint, a PaddleNLP
`save_pretrained` folder (safetensors or pdparams, sharded or not), or a transformers folder of any
registered family, read in place under any layout.

`open_pretrained` runs before any process group: it recognises the folder, turns its config.json
into ours (every field modelled, harmless, or refused by name: `TransformersAdapter.our_config`),
and checks every tensor's name and shape against the family's plan from the file headers, so a
wrong folder fails on every rank with the same message. `load_pretrained` then has each rank read
only its TP slices (positioned reads; transformers' [out, in] linears are sliced along the other
axis and transposed, a fused tensor's slice is cut out first), as a resume does.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.format import CONFIG_FILE, MODEL, WEIGHTS_LAYOUT, CheckpointError, index_name
from checkpoint.load import (
    LOAD_ERRORS,
    agree_on_outcome,
    checking_ranks,
    checkpoint_error,
    load_checkpoint,
    set_parameter,
)
from checkpoint.piece import Piece
from checkpoint.shards import ShardReader, file_checksum, recorded_checksum
from checkpoint.unified_io import UnifiedReader
from modeling.config import ModelConfigError
from modeling.family import ModelFamily
from modeling.fused_experts import fused_expert_stored, stores_fused_experts
from modeling.multimodal import MULTIMODAL, Multimodal
from modeling.paddlenlp_fused import FFN, QKV, fused_stored
from modeling.placement import ModelPlan, split_tensor
from modeling.registry import UnknownModelError, config_from_dict, family, plan_of
from modeling.transformers_adapter import RUN_FIELDS, ConfigFieldError, Stored
from paddle_pp.interop.carried import Carried, text_config
from paddle_pp.interop.pickled import load_pickled
from paddle_pp.interop.prediction_layers import Absent, absent_prediction_layers
from paddle_pp.interop.quantized import dequantizing
from paddle_pp.interop.recut import recut
from paddle_pp.runtime.topology import Topology

UNIFIED, PADDLENLP, TRANSFORMERS = "paddle-pp unified checkpoint", "PaddleNLP", "transformers"
CONFIG_ONLY = "config-only"  # opened for its config.json, weights neither read nor checked
PDPARAMS, PDPARAMS_INDEX = "model_state.pdparams", "model_state.pdparams.index.json"
HF_INDEX = index_name(MODEL)  # transformers and PaddleNLP name their sharded safetensors index like ours

Read = Callable[[str, int | None, int, int], np.ndarray]  # (name, TP axis, parts, part) -> this rank's piece


def _by_axis(read_piece: Callable[[str, Piece], np.ndarray]) -> Read:
    """A `Read` from a reader of `Piece`s (the nested cuts of fused tensors below count in axes and parts)."""
    return lambda name, axis, parts, part: read_piece(name, Piece(axis, parts, part))


@dataclass
class PretrainedFolder:
    """A recognised model folder: its kind, our config for it, and a reader of single-card tensors."""

    folder: Path
    kind: str
    config: dict
    read: Read = field(repr=False)
    notes: tuple[str, ...] = ()  # what a run from it should be told (tensors left unread)
    carried: Carried | None = None  # a multimodal folder's parts that do not train, carried as they are
    fresh: tuple[str, ...] = ()  # our tensors the folder does not hold and a run initialises (`prediction_layers`)


def open_pretrained(folder: Path, weights: bool = True, allow_unsafe_pickle: bool = False,
                    fresh_prediction_layers: bool = False) -> PretrainedFolder:
    """The folder recognised and checked (config, every tensor name and shape from file headers)
    without reading weights. `weights` False (a run that resumes its own checkpoint, or takes only
    the config): the weights are neither read nor checked, so a folder may hold config.json alone.
    Pickled pdparams are read as data only (`pickled.load_pickled`) unless `allow_unsafe_pickle`.
    Multi-token prediction layers the config counts and the folder does not hold are left out, or
    started fresh under `fresh_prediction_layers` (`prediction_layers.absent_prediction_layers`)."""
    folder = Path(folder)
    if not folder.exists() and _looks_like_a_hub_id(str(folder)):
        raise CheckpointError(f"--model_name_or_path {folder}: no such folder, and it reads like a model hub id; "
                              "this trainer does not download (no network is assumed): download the model once "
                              "(e.g. huggingface-cli download or PaddleNLP's from_pretrained elsewhere) and pass "
                              "its local folder")
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"--model_name_or_path {folder}: no {CONFIG_FILE} there; pass a folder saved by "
                              "paddle-pp, PaddleNLP's save_pretrained or transformers' save_pretrained")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    kind = MULTIMODAL.get(raw.get("model_type"))
    if kind is not None:  # its language model is what trains: read as a text folder's, the rest carried
        return _multimodal(folder, raw, kind, weights, fresh_prediction_layers)
    if _is_unified(folder):
        unified = UnifiedReader(folder, MODEL)
        # a LoRA run's checkpoint keeps its adapters' settings beside the model's fields
        config = {"model_type": raw.get("model_type"), **_config_fields(raw),
                  **({"lora": raw["lora"]} if raw.get("lora") else {})}
        shapes = {name: meta["shape"] for name, meta in unified.tensors.items()}
        return _checked(folder, UNIFIED, config, shapes, _by_axis(unified.read), Stored)
    model_family, config, fused = _our_config(folder, raw)
    paddlenlp_locate = _paddlenlp_locator(config, fused)
    pickled = (folder / PDPARAMS).is_file() or (folder / PDPARAMS_INDEX).is_file()
    if not weights:  # a config.json alone is enough (PaddleNLP's continue_training false on a config folder)
        if pickled:
            return PretrainedFolder(folder, PADDLENLP, config, read=_not_loaded)
        if not ((folder / HF_INDEX).is_file() or any(folder.glob("*.safetensors"))):
            return PretrainedFolder(folder, CONFIG_ONLY, config, read=_not_loaded)
        shapes = _header_shapes(_safetensors_readers(folder))
        if _kind(model_family, config, shapes) != TRANSFORMERS:
            return PretrainedFolder(folder, PADDLENLP, config, read=_not_loaded)
        return _unread_transformers_folder(folder, model_family, config, shapes, fresh_prediction_layers)
    if pickled:
        arrays = _pdparams(folder, allow_unsafe_pickle)
        return _checked(folder, PADDLENLP, config, {name: list(a.shape) for name, a in arrays.items()},
                        lambda key, axis, parts, part: split_tensor(arrays[key], axis, parts, part), paddlenlp_locate)
    readers = _safetensors_readers(folder, raw.get("quantization_config"))
    shapes = _header_shapes(readers)
    read = _by_axis(lambda key, piece: readers[key].read(key, piece))
    if _kind(model_family, config, shapes) == TRANSFORMERS:
        return _transformers_folder(folder, model_family, config, shapes, read, fresh_prediction_layers=fresh_prediction_layers)
    return _checked(folder, PADDLENLP, config, shapes, read, paddlenlp_locate)


def _transformers_locate(model_family: ModelFamily, ours, shapes: dict[str, list[int]],
                         kind: Multimodal | None) -> Callable[[str], Stored]:
    """Where a transformers folder of `model_family` stores each of our tensors: where the family's
    adapter says, in transformers 5's fused experts when the folder holds them, inside a multimodal
    `kind`'s text body when given."""
    plan, adapter = plan_of(ours), model_family.transformers
    locate = lambda name: adapter.stored(name, plan[name], ours)  # noqa: E731
    if stores_fused_experts(shapes) and not getattr(ours, "experts_stacked", False):
        locate = lambda name, per_expert=locate: fused_expert_stored(per_expert(name), ours)  # noqa: E731
    if kind is not None:
        locate = lambda name, text=locate: kind.stored(text(name))  # noqa: E731
    return locate


def _absent(folder: Path, model_family: ModelFamily, config: dict, ours, shapes: dict[str, list[int]], fresh: bool,
            kind: Multimodal | None = None) -> Absent | None:
    """The prediction layers `config` (built: `ours`) counts when the folder holds none of their tensors."""
    if not ours.mtp_depth:  # most families: no plan to locate
        return None
    locate = _transformers_locate(model_family, ours, shapes, kind)
    return absent_prediction_layers(folder, config, ours, lambda name: locate(name).name in shapes, fresh)


def _unread_transformers_folder(folder: Path, model_family: ModelFamily, config: dict, shapes: dict[str, list[int]],
                                fresh: bool, kind: Multimodal | None = None) -> PretrainedFolder:
    """A transformers folder opened for its config alone (weights neither read nor checked), its absent
    prediction layers decided as a run that reads it decides them, so a resume builds the same model."""
    absent = _absent(folder, model_family, config, config_from_dict(config), shapes, fresh, kind)
    return PretrainedFolder(folder, TRANSFORMERS, absent.config if absent else config, read=_not_loaded,
                            notes=(absent.note,) if absent else (), fresh=absent.fresh if absent else ())


def _transformers_folder(folder: Path, model_family: ModelFamily, config: dict, shapes: dict[str, list[int]],
                         read: Read, kind: Multimodal | None = None,
                         fresh_prediction_layers: bool = False) -> PretrainedFolder:
    """A transformers folder of `model_family` checked and read: each tensor where `_transformers_locate`
    says (cut again where its folders may cut a group elsewhere), whose multimodal parts' tensors are
    left to carry, and whose absent prediction layers are left out or started fresh."""
    ours = config_from_dict(config)
    absent = _absent(folder, model_family, config, ours, shapes, fresh_prediction_layers, kind)
    if absent is not None:
        config, ours = absent.config, config_from_dict(absent.config)
    plan, adapter = plan_of(ours), model_family.transformers
    locate = _transformers_locate(model_family, ours, shapes, kind)
    if adapter.recut:
        expected = {locate(name).name: stored_shape(plan[name].shape, locate(name)) for name in plan}
        shapes, read = recut(shapes, read, adapter.recut, expected)
    opened = _checked(folder, TRANSFORMERS, config, shapes, read, locate, adapter.buffers, adapter.layers_past_last,
                      adapter.stored_copies(ours), adapter.unread + _unused(ours, kind), () if kind is None else kind.carried,
                      absent.fresh if absent else ())
    return replace(opened, notes=(absent.note, *opened.notes)) if absent else opened


def _unused(ours, kind: Multimodal | None) -> tuple[str, ...]:
    """The name prefixes of what some folders of `ours` store that its model does not use (Gemma 4's
    released folders keep projections for the layers that reuse earlier keys and values), where the
    folder kind keeps them."""
    names = ours.unused_stored()
    return names if kind is None else tuple(kind.stored(Stored(name)).name for name in names)


def _multimodal(folder: Path, raw: dict, kind: Multimodal, weights: bool, fresh_prediction_layers: bool) -> PretrainedFolder:
    """A multimodal transformers folder (`modeling.multimodal`): its language model's config and
    tensors, read as the text family's folders keep them under the kind's body, and every tensor under
    the kind's `carried` prefixes held as stored (`Carried`)."""
    model_family, config, _ = _our_config(folder, text_config(raw, folder))
    if not weights:
        return _unread_transformers_folder(folder, model_family, config, _header_shapes(_safetensors_readers(folder)),
                                           fresh_prediction_layers, kind)
    if raw.get("quantization_config"):
        raise CheckpointError(f"--model_name_or_path {folder}: a quantized {kind.model_type} folder; its carried parts "
                              "would be written back dequantized. Pass its unquantized release")
    stored = _safetensors_readers(folder)
    readers = {kind.as_released(name): (reader, name) for name, reader in stored.items()}
    shapes = {name: reader.shape(key) for name, (reader, key) in readers.items()}
    carried = tuple(sorted(name for name in shapes if name.startswith(kind.carried)))
    pretrained = _transformers_folder(folder, model_family, config, shapes,
                                      _by_axis(lambda name, piece: readers[name][0].read(readers[name][1], piece)),
                                      kind, fresh_prediction_layers)
    return replace(pretrained, notes=pretrained.notes + (
        f"{folder}: {len(carried)} tensors of its other parts ({', '.join(kind.carried)}) carried through every "
        "checkpoint as they are",), carried=Carried(raw, carried, lambda name: stored[name].read_stored(name)))


def _paddlenlp_locator(config: dict, fused: frozenset[str]) -> Callable[[str], Stored]:
    """Where a PaddleNLP folder stores each of our tensors: under our name, or inside the fused
    projections its config.json asks for (`modeling.paddlenlp_fused`)."""
    if not fused:
        return Stored
    ours = config_from_dict(config)
    plan = plan_of(ours)
    return lambda name: fused_stored(name, plan[name], ours, fused)


def _looks_like_a_hub_id(name: str) -> bool:
    """"owner/model" as hubs name models (PaddleNLP's recipes name them so: meta-llama/Meta-Llama-3-8B)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _safetensors_readers(folder: Path, quantization: dict | None = None) -> dict[str, ShardReader]:
    """A reader for every tensor of the folder's files; quantized ones (`quantization`: the config's)
    read as the tensor they hold (`interop.quantized`)."""
    return dequantizing({name: reader for reader in map(ShardReader, _safetensors_files(folder))
                         for name in reader.names}, quantization)


def _header_shapes(readers: dict[str, ShardReader]) -> dict[str, list[int]]:
    return {name: reader.shape(name) for name, reader in readers.items()}


def _kind(model_family: ModelFamily, config: dict, shapes: dict) -> str:
    """TRANSFORMERS or PADDLENLP for a safetensors folder, from the tensor names in its headers."""
    ours = config_from_dict(config)
    theirs = model_family.transformers is not None and _theirs(plan_of(ours), ours, model_family, shapes)
    return TRANSFORMERS if theirs else PADDLENLP


def _theirs(plan: ModelPlan, config, model_family: ModelFamily, shapes: dict) -> bool:
    """Whether the folder's names are transformers' rather than PaddleNLP's (= ours)."""
    theirs = {model_family.transformers.stored(name, row, config).name for name, row in plan.items()}
    return len(theirs & set(shapes)) > len(set(plan) & set(shapes))


def _not_loaded(name: str, *_piece) -> np.ndarray:
    raise CheckpointError(f"{name}: the folder was opened for its config only (open_pretrained(weights=False))")


def _is_unified(folder: Path) -> bool:
    """A paddle-pp checkpoint in our own layout (one saved with --save_to_hf reads as transformers')."""
    metadata = _index_metadata(folder)
    return "format_version" in metadata and WEIGHTS_LAYOUT not in metadata


def _index_metadata(folder: Path) -> dict:
    index = folder / HF_INDEX
    return json.loads(index.read_text()).get("metadata", {}) if index.is_file() else {}


def _config_fields(raw: dict) -> dict:
    """The fields of our own config.json the family's config class takes (it also holds PaddleNLP's
    defaults for generation and kernels), None included: written from our config, a null is its value
    (V2-Lite's `q_lora_rank`, a window that is off), not a field left unset."""
    accepted = set()
    for cls in family(raw.get("model_type")).config_class.__mro__:
        if "__init__" in cls.__dict__:
            accepted |= set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in raw.items() if k in accepted and k not in RUN_FIELDS}


def our_config_of(raw: dict, source: Path) -> dict:
    """Our config of a transformers or PaddleNLP config.json's values (`source`: where they were read),
    checked field by field as a folder's (a field spelled otherwise, `n_routed_experts`, is read under
    our name, never dropped)."""
    return _our_config(source, raw)[1]


def _our_config(folder: Path, raw: dict) -> tuple[ModelFamily, dict, frozenset[str]]:
    """config.json of a PaddleNLP or transformers folder as our config, after every field is found
    modelled or harmless (`TransformersAdapter.our_config`); anything else is refused by name. PaddleNLP's
    fused-projection flags are returned apart: they say where tensors are stored, not what is computed."""
    try:
        model_family = family(raw.get("model_type"))
    except UnknownModelError as err:
        raise CheckpointError(f"--model_name_or_path {folder}: {err} ({raw.get('architectures')})") from err
    if model_family.transformers is None:
        raise CheckpointError(f"--model_name_or_path {folder}: {model_family.architecture} loads only from paddle-pp "
                              "checkpoints (its family has no transformers mapping)")
    fused = frozenset(flag for flag in (QKV, FFN) if raw.get(flag))
    if fused - model_family.paddlenlp_fused:
        raise CheckpointError(f"--model_name_or_path {folder}: config.json sets {', '.join(sorted(fused))}, which "
                              f"PaddleNLP's {model_family.architecture} does not have (it fuses "
                              f"{', '.join(sorted(model_family.paddlenlp_fused)) or 'nothing'}); the folder's "
                              "layout is unknown")
    try:
        config = {"model_type": model_family.model_type,
                  **model_family.transformers.our_config({k: v for k, v in raw.items() if k not in (QKV, FFN)},
                                                         model_family.config_class)}
        config_from_dict(config).validate()
    except (ConfigFieldError, ModelConfigError, TypeError) as err:
        raise CheckpointError(f"--model_name_or_path {folder}: config.json {err}. paddle-pp's "
                              f"{model_family.architecture} computes only what it models; a field that would "
                              "train another model is refused rather than ignored") from err
    return model_family, config, fused


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


def _pdparams(folder: Path, allow_unsafe_pickle: bool) -> dict[str, np.ndarray]:
    """PaddleNLP's pickled weights, loaded whole (the format has no positioned reads, so each rank
    holds the whole state while it loads: prefer safetensors for large models)."""
    if (folder / PDPARAMS_INDEX).is_file():
        files = sorted(set(json.loads((folder / PDPARAMS_INDEX).read_text())["weight_map"].values()))
    else:
        files = [PDPARAMS]
    state: dict[str, np.ndarray] = {}
    for fname in files:
        if not (folder / fname).is_file():
            raise CheckpointError(f"{folder / fname} is missing (listed in {PDPARAMS_INDEX})")
        state |= {k: np.asarray(v) for k, v in load_pickled(folder / fname, allow_unsafe_pickle).items()}
    return state


def stored_shape(shape, stored: Stored) -> list[int]:
    """The shape of the tensor a folder stores for one of ours of `shape`."""
    shape = list(shape)[::-1] if stored.transposed else list(shape)
    if stored.sizes is not None:
        shape[stored.axis] = sum(stored.sizes)
    elif stored.parts > 1:
        shape[stored.axis] *= stored.parts
    if stored.interleave is not None:
        group, _, width = stored.interleave
        shape[stored.axis] = shape[stored.axis] // width * group
    return shape if stored.stack is None else [stored.stack[1]] + shape


def _checked(folder: Path, kind: str, config: dict, shapes: dict[str, list[int]], read_stored: Read,
             locate: Callable[[str], Stored], buffers: tuple[str, ...] = (),
             layers_past_last: str | None = None, copies: dict[str, str] | None = None,
             unread: tuple[str, ...] = (), carried: tuple[str, ...] = (), fresh: tuple[str, ...] = ()) -> PretrainedFolder:
    """The folder's reader under our names, after every planned tensor is found in its stored shape
    and no stored tensor is left over (a tied head's second name, recomputed buffers and `copies` of
    ours aside, and the layers a family's folders store past the config's last, `layers_past_last`,
    and the tensors under its `unread` prefixes: left unread, noted; those under `carried` prefixes are
    a multimodal folder's other parts; the `fresh` tensors a run initialises are not looked for)."""
    plan = plan_of(config_from_dict(config))
    problems = []
    for name in plan:
        if name in fresh:
            continue
        stored = locate(name)
        if stored.name not in shapes:
            hint = f" (config.json has tie_word_embeddings={config.get('tie_word_embeddings')})" \
                if any(name in names for names in plan.tied) or "head" in name else ""
            problems.append(f"{stored.name}: missing{hint}")
        elif list(shapes[stored.name]) != stored_shape(plan[name].shape, stored):
            problems.append(f"{stored.name}: shape {list(shapes[stored.name])} in the folder, the model needs "
                            f"{stored_shape(plan[name].shape, stored)}")
    expected = {locate(name).name for name in plan} | {alias for names in plan.tied for alias in names[1:]} \
        | set(copies or ())
    left_over = [key for key in sorted(shapes) if key not in expected and not key.endswith(buffers)
                 and not key.startswith(carried)]
    past = {key: index for key in left_over if layers_past_last
            and (index := _layer_index(key, config["num_hidden_layers"])) is not None}
    skipped = [key for key in left_over if unread and key.startswith(unread)]
    problems += [f"{key}: not a tensor of {plan.architecture}" for key in left_over
                 if key not in past and key not in skipped]
    if problems:
        raise CheckpointError(f"--model_name_or_path {folder} ({kind}) does not match the model its config.json "
                              "describes: " + "; ".join(problems[:6])
                              + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""))

    def read(name: str, axis: int | None, parts: int, part: int) -> np.ndarray:
        stored, source = locate(name), read_stored
        if stored.stack is not None:  # our tensor is in one entry of a stack: read that entry, then as below
            index, count = stored.stack
            entry = read_stored(stored.name, 0, count, index)[0]
            source = lambda _, axis, parts, part: split_tensor(entry, axis, parts, part)  # noqa: E731
        if stored.interleave is not None:  # a tp rank's heads are whole groups of the stored tensor
            piece = stored.select(source(stored.name, None if axis is None else stored.axis, parts, part))
            return piece.T if stored.transposed else piece
        if stored.sizes is not None:  # our tensor is an unequal slice of a fused one: this rank's piece of it
            return _span_piece(source, stored, axis, parts, part)
        if stored.parts > 1 and axis == stored.axis and not stored.transposed:  # this rank's piece of our slice
            return source(stored.name, axis, stored.parts * parts, stored.part * parts + part)
        if stored.parts > 1:  # our tensor is a slice of a fused one: cut it out, then this rank's piece
            whole = source(stored.name, stored.axis, stored.parts, stored.part)
            return split_tensor(whole.T if stored.transposed else whole, axis, parts, part)
        flip = stored.transposed
        piece = source(stored.name, None if axis is None else (1 - axis if flip else axis), parts, part)
        return piece.T if flip else piece

    notes = (f"{folder}: {len(past)} tensors of layers {', '.join(map(str, sorted(set(past.values()))))} left unread: {layers_past_last} "
             "layers past the model's last, which this config does not count (transformers leaves them unread too)",
             ) if past else ()
    if skipped:
        notes += (f"{folder}: {len(skipped)} tensors under {', '.join(p for p in unread if any(k.startswith(p) for k in skipped))} "
                  f"left unread: {plan.architecture} does not model them (transformers leaves them unread too)",)
    return PretrainedFolder(folder, kind, config, read, notes, fresh=fresh)


def _layer_index(key: str, num_layers: int) -> int | None:
    """The decoder layer a transformers tensor name belongs to when it is past the last (`num_layers`)."""
    parts = key.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers:
        return int(parts[2])
    return None


def _span_piece(source: Read, stored: Stored, axis: int | None, parts: int, part: int) -> np.ndarray:
    """This rank's piece of our part of a tensor fused from parts of unequal widths (`Stored.sizes`),
    read as the equal units of their greatest common width that make it up."""
    start, width = stored.span()
    along = None if axis is None else (1 - axis if stored.transposed else axis)
    if along == stored.axis:  # tp cuts our part along the fused axis: read only this rank's rows of it
        start, width = start + part * width // parts, width // parts
    total = sum(stored.sizes)
    unit = math.gcd(start, width, total)
    piece = np.concatenate([source(stored.name, stored.axis, total // unit, index)
                            for index in range(start // unit, (start + width) // unit)], axis=stored.axis)
    piece = piece.T if stored.transposed else piece
    return piece if along == stored.axis else split_tensor(piece, axis, parts, part)


def _check_recorded_checksums(folder: Path, topo: Topology | None) -> None:
    """A paddle-pp checkpoint in transformers' layout records its files' checksums: each file is
    checked by one rank (spread by bytes, as a resume checks our layout's)."""
    metadata = _index_metadata(folder)
    files = metadata.get("files", {}) if WEIGHTS_LAYOUT in metadata else {}
    ranks, rank = (topo.layout.world_size, topo.global_rank) if topo is not None else (1, 0)
    checker = checking_ranks([{fname: entry["size"] for fname, entry in files.items()}] * ranks)
    for fname, entry in sorted(files.items()):
        if checker[fname] != rank:
            continue
        path = folder / fname
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise CheckpointError(f"{path} is missing or not the {entry['size']} bytes the index records: restore it "
                                  "or resume from an older checkpoint")
        algorithm, expected = recorded_checksum(entry)
        if file_checksum(path, algorithm) != expected:
            raise CheckpointError(f"{path} fails its {algorithm} checksum: the file is corrupted; restore it or "
                                  "resume from an older checkpoint")


def load_pretrained(pretrained: PretrainedFolder, model, axes: dict, topo: Topology | None) -> None:
    """Fill `model`'s parameters (this rank's TP slices) from the folder; a failure on any rank
    fails every rank. `topo` None: one process, single card (tools)."""
    if pretrained.kind == UNIFIED and topo is not None:
        load_checkpoint(pretrained.folder, model, None, topo, axes)  # with its checksums, spread over the ranks
        return
    tp, tp_rank = (topo.layout.tp, topo.tp_rank) if topo is not None else (1, 0)
    try:
        for name, param in model.state_dict().items():
            if name in pretrained.fresh:  # kept as the model initialised it
                continue
            axis = axes.get(name) if tp > 1 else None
            set_parameter(param, pretrained.read(name, axis, tp, tp_rank))
        _check_recorded_checksums(pretrained.folder, topo)
        outcome = None
    except LOAD_ERRORS as err:
        outcome = checkpoint_error(err)
    if topo is not None:
        agree_on_outcome(outcome, pretrained.folder, topo)
    elif outcome is not None:
        raise outcome
