"""A PaddleFormers 1.2 training checkpoint, in either of its formats, turned into a unified one
which this trainer resumes under any layout (`tools/reshard.py paddleformers`), and a unified
checkpoint written back in its default flex format (`tools/reshard.py to-flex`, `export_flex`).

The flex format (`trainer.py` `_save_flex_model_state` / `_save_flex_optimizer_state`): `model_state/`
with a plain family's tensors under transformers' names (`model.layers.0.self_attn.q_proj.weight`)
in Paddle's [in, out] layout for linears, the head as transformers keeps it ([vocab, hidden]);
`optimizer_state/` with AdamW's `<name>.moment1_0`, `.moment2_0`, `.beta1_pow_acc_0`,
`.beta2_pow_acc_0`; `master_weight/` with fp32 masters `<name>.w_0` under mixed precision (an empty
one in fp32); `trainer_state.bin` (a pickled TrainerState: global_step, consumed_samples) and
`scheduler.pdparams`. Each tensor is taken whole from its pieces (`interop/flex.py`) and placed by
its shape: as ours, or transposed where only the transpose fits (the head). A flex checkpoint has no
config.json: the model's comes from the folder the run started from (`model_folder`), which also
gives the tokenizer.

Its unified checkpoint (`unified_checkpoint/load_save_single_card.py`): the weights are a transformers
folder (names, [out, in] linears, `format: pt`, config.json beside them), read as one; the optimizer's
`optimizer-*.safetensors` keep `<name>/moment1_0` ... under transformers' names in Paddle's layout
(`format: np`: the tensors as PaddleFormers holds them, the head [vocab, hidden]), and
`master_weights-*.safetensors` (under mixed precision only; read from PaddleFormers' source, not
produced on CPU here) the fp32 masters by name in the same layout. Each file's layout is taken from its
own `format` metadata, not assumed. Families PaddleFormers fuses internally (ERNIE 4.5's qkv_proj,
Gemma 3's up_gate_proj) are refused by the names they lack.

The way back writes the same names, layouts and files through Paddle's own `save_state_dict` (one
process, each tensor whole: a checkpoint of any layout loads from it, as PaddleFormers resumes one
through `load_state_dict`). It holds the weights, then the optimizer's states and masters, in memory
whole, since `save_state_dict` takes whole tensors. PaddleFormers 1.2's Trainer resumes it
(tests/test_paddleformers.py).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from checkpoint.format import (
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    TRAINER_STATE_PICKLE,
    CheckpointError,
    index_name,
)
from checkpoint.optimizer_state import MASTER_WEIGHT, state_tp_axis
from checkpoint.shards import ShardReader
from checkpoint.split import DEFAULT_SHARD_BYTES
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.fleet import scheduler_state, write_rank_arrays, write_unified
from paddle_pp.interop.flex import FlexFolder, flex_parts
from paddle_pp.interop.pickled import load_pickled_record
from paddle_pp.interop.pretrained import open_pretrained

ADAM_STATES = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")  # Paddle AdamW's accumulators, `_0` on disk
MASTER_SUFFIX = "w_0"
OPTIMIZER_INDEX, MASTER_WEIGHTS_INDEX = "optimizer.safetensors.index.json", "master_weights.safetensors.index.json"
TRAINER_STATE_CLASS = ("paddleformers.trainer.trainer_callback", "TrainerState")


def _placed(array: np.ndarray, shape: tuple, what: str) -> np.ndarray:
    """`array` in our layout for a tensor of `shape`: as stored, or transposed where only that fits."""
    if tuple(array.shape) == tuple(shape):
        return array
    if array.ndim == 2 and tuple(array.shape[::-1]) == tuple(shape):
        return np.ascontiguousarray(array.T)
    raise CheckpointError(f"{what} is {list(array.shape)} in the flex checkpoint; this model's is {list(shape)}")


def _float32(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32, copy=False)


def _their_names(config, plan) -> dict[str, str]:
    """Our single-card name -> the name PaddleFormers saves it under (transformers')."""
    adapter, names = family_of(config).transformers, {}
    for name, row in plan.items():
        stored = adapter.stored(name, row, config)
        if stored.axis is not None or stored.stack is not None:
            raise CheckpointError(f"{name} is part of a fused tensor ({stored.name}) in transformers' layout; importing "
                                  f"a flex checkpoint of {family_of(config).architecture} is not implemented")
        names[name] = stored.name
    return names


def _weights(model: FlexFolder, names: dict[str, str], plan) -> dict[str, np.ndarray]:
    missing = sorted(theirs for theirs in names.values() if theirs not in model.metadata.state_dict_metadata)
    if missing:
        raise CheckpointError(f"{model.folder} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                              "(a family PaddleFormers fuses internally, or another model than --model's config)")
    return {ours: _placed(_float32(model.tensor(theirs)), plan[ours].shape, theirs) for ours, theirs in names.items()}


def _states(parts: dict[str, FlexFolder], names: dict[str, str], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our optimizer keys (`<name>/moment1` ...) from optimizer_state/ and master_weight/."""
    optimizer, masters = parts.get("optimizer_state"), parts.get("master_weight")
    states = {}
    for ours, theirs in names.items():
        for state in ADAM_STATES:
            key = f"{theirs}.{state}_0"
            if optimizer is not None and key in optimizer.metadata.state_dict_metadata:
                value = _float32(optimizer.tensor(key))
                states[f"{ours}{STATE_SEPARATOR}{state}"] = value if value.size == 1 else \
                    _placed(value, weights[ours].shape, key)
        key = f"{theirs}.{MASTER_SUFFIX}"
        if masters is not None and key in masters.metadata.state_dict_metadata:
            states[f"{ours}{STATE_SEPARATOR}{MASTER_WEIGHT}"] = _placed(_float32(masters.tensor(key)),
                                                                       weights[ours].shape, key)
    return states


def _trainer_state(source: Path) -> dict:
    path = source / TRAINER_STATE_PICKLE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the import needs the step and consumed samples to resume")
    theirs = load_pickled_record(path, {TRAINER_STATE_CLASS: SimpleNamespace})
    if not hasattr(theirs, "global_step"):
        raise CheckpointError(f"{path} is not PaddleFormers' TrainerState")
    return {"format_version": FORMAT_VERSION, "step": int(theirs.global_step),
            "consumed_samples": int(getattr(theirs, "consumed_samples", 0)),
            "lr_scheduler": scheduler_state(source, {}, False), "imported_from": str(source)}


def _layout_of(reader: ShardReader, expected: str, what: str) -> None:
    found = reader.metadata.get("format")
    if found != expected:
        raise CheckpointError(f"{reader.path} stores {what} in format {found!r}; PaddleFormers 1.2 writes them in "
                              f"{expected!r} (its layout for them), and no other layout is read")


def _unified_states(source: Path, names: dict[str, str], weights: dict[str, np.ndarray],
                    head: str) -> dict[str, np.ndarray]:
    """Our optimizer keys from PaddleFormers' optimizer and master-weight files (Paddle's layout,
    the head [vocab, hidden])."""
    states = {}
    for index_file, suffixes in ((OPTIMIZER_INDEX, {state: f"/{state}_0" for state in ADAM_STATES}),
                                 (MASTER_WEIGHTS_INDEX, {MASTER_WEIGHT: ""})):
        if not (source / index_file).is_file():
            continue
        weight_map = json.loads((source / index_file).read_text())["weight_map"]
        readers = {file: ShardReader(source / file) for file in sorted(set(weight_map.values()))}
        for reader in readers.values():
            _layout_of(reader, "np", "optimizer states")
        unread = set(weight_map)
        for ours, theirs in names.items():
            for state, suffix in suffixes.items():
                key = theirs + suffix
                if key not in weight_map:
                    continue
                unread.discard(key)
                value = _float32(readers[weight_map[key]].read(key))
                states[f"{ours}{STATE_SEPARATOR}{state}"] = value if value.size == 1 else \
                    _placed(_their_layout(value, ours, head), weights[ours].shape, key)
        if unread:
            raise CheckpointError(f"{source / index_file} holds states of tensors this model lacks: "
                                  f"{', '.join(sorted(unread)[:4])}")
    return states


def import_unified(source: Path, target: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                   on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write PaddleFormers' unified checkpoint `source` as ours at `target` (its config and tokenizer
    are in it)."""
    source = Path(source)
    for file in sorted(set(json.loads((source / index_name(MODEL)).read_text())["weight_map"].values())):
        _layout_of(ShardReader(source / file), "pt", "weights")
    folder = open_pretrained(source)
    config = config_from_dict(folder.config)
    plan = plan_of(config)
    names, head = _their_names(config, plan), f"{family_of(config).skeleton.head}.weight"
    weights = {ours: _float32(folder.read(ours, None, 1, 0)) for ours in names}
    states = _unified_states(source, names, weights, head)
    return _write_imported(target, config, plan, weights, states, _trainer_state(source), source, max_shard_bytes,
                           on_tensor)


def import_flex(source: Path, target: Path, model_folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write PaddleFormers' flex checkpoint `source` (a checkpoint-<step> folder) as a unified checkpoint
    at `target`, the model's config and tokenizer taken from `model_folder`."""
    source, model_folder = Path(source), Path(model_folder)
    parts = flex_parts(source)
    if "model_state" not in parts:
        raise CheckpointError(f"{source} has no model_state/ flex folder")
    config = config_from_dict(open_pretrained(model_folder, weights=False).config)
    plan = plan_of(config)
    names = _their_names(config, plan)
    weights = _weights(parts["model_state"], names, plan)
    return _write_imported(target, config, plan, weights, _states(parts, names, weights), _trainer_state(source),
                           model_folder, max_shard_bytes, on_tensor)


def import_paddleformers(source: Path, target: Path, model_folder: Path | None = None,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                         on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A PaddleFormers checkpoint in either of its formats, told apart by its files, as ours at `target`
    (a flex one needs `model_folder` for the config and tokenizer it lacks)."""
    source = Path(source)
    if (source / "model_state").is_dir():
        if model_folder is None:
            raise CheckpointError(f"{source} is a flex checkpoint, which holds no config.json: pass --model, the "
                                  "folder the run started from")
        return import_flex(source, target, model_folder, max_shard_bytes, on_tensor)
    if (source / index_name(MODEL)).is_file() and (source / TRAINER_STATE_PICKLE).is_file():
        return import_unified(source, target, max_shard_bytes, on_tensor)
    raise CheckpointError(f"{source} is not a PaddleFormers checkpoint (neither model_state/ of a flex one nor "
                          f"{index_name(MODEL)} with {TRAINER_STATE_PICKLE} of a unified one)")


def _write_imported(target: Path, config, plan, weights: dict[str, np.ndarray], states: dict[str, np.ndarray],
                    trainer_state: dict, tokenizer_folder: Path, max_shard_bytes: int,
                    on_tensor: Callable[[str, int], None] | None) -> Path:
    """Weights and states of single-card names and shapes as a unified checkpoint, their tp axes
    recorded (how `reshard split` and every loader cut them)."""
    axes = plan.axes()

    def axis(key: str, array: np.ndarray) -> int | None:
        param = key.split(STATE_SEPARATOR)[0]
        return state_tp_axis(array.shape, weights[param].shape, axes.get(param))

    def write(writer) -> None:
        write_rank_arrays(writer, MODEL, 0, 0, weights, axis, 1)
        if states:
            write_rank_arrays(writer, OPTIMIZER, 0, 0, states, axis, 1)

    return write_unified(Path(target), config, plan, (1, 1), write, trainer_state, tokenizer_folder,
                         max_shard_bytes, on_tensor)


# PaddleFormers' TrainerState fields (as PaddleNLP's, which it forked) with their defaults.
TRAINER_STATE_FIELDS = {"epoch": None, "global_step": 0, "consumed_samples": 0, "max_steps": 0, "num_train_epochs": 0,
                        "total_flos": 0, "log_history": [], "best_metric": None, "best_model_checkpoint": None,
                        "is_local_process_zero": True, "is_world_process_zero": True, "trial_name": None,
                        "trial_params": None}


def pickled_instance(module: str, name: str, fields: dict) -> bytes:
    """A pickle of an instance of `module`.`name` whose attributes are `fields`, as pickle writes a
    dataclass instance (NEWOBJ, then BUILD with its __dict__), made without importing the class: the
    fields are pickled alone and framed by those opcodes."""
    body = pickle.dumps(fields, protocol=2)[2:-1]  # without its PROTO 2 header and STOP
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")\x81" + body + b"b."


def _their_layout(array: np.ndarray, ours: str, head: str) -> np.ndarray:
    """PaddleFormers' layout of our tensor `ours`: Paddle's [in, out] as ours, but the head (LMHead)
    [vocab, hidden], as transformers keeps it."""
    return np.ascontiguousarray(array.T) if ours == head else array


def _save_kind(arrays: dict[str, np.ndarray], folder: Path) -> None:
    import paddle
    import paddle.distributed as dist

    dist.save_state_dict({key: paddle.to_tensor(array) for key, array in arrays.items()}, str(folder))


def export_flex(source: Path, target: Path, on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write the unified checkpoint `source` (either weights layout) as PaddleFormers' flex checkpoint
    `target`: model_state/, optimizer_state/ (AdamW's `<name>.moment1_0` ...), master_weight/ (`<name>.w_0`,
    when the run kept fp32 masters), trainer_state.bin (its TrainerState, pickled under PaddleFormers'
    class), scheduler.pdparams and the tokenizer files."""
    import paddle

    from checkpoint.durable import new_folder
    from checkpoint.format import TRAINER_STATE_FILE, copy_tokenizer_files
    from checkpoint.unified_io import UnifiedReader
    from paddle_pp.interop.transformers_layout import checkpoint_config

    source = Path(source)
    config = config_from_dict(checkpoint_config(source))
    plan = plan_of(config)
    names, head = _their_names(config, plan), f"{family_of(config).skeleton.head}.weight"
    state = json.loads((source / TRAINER_STATE_FILE).read_text())
    weights = open_pretrained(source)

    def read(name: str, array: np.ndarray) -> np.ndarray:
        if on_tensor:
            on_tensor(name, array.nbytes)
        return array

    with new_folder(target) as partial:
        _save_kind({theirs: _their_layout(read(ours, weights.read(ours, None, 1, 0)), ours, head)
                    for ours, theirs in names.items()}, partial / "model_state")
        if (source / index_name(OPTIMIZER)).is_file():
            states, by_kind = UnifiedReader(source, OPTIMIZER), {"optimizer_state": {}, "master_weight": {}}
            for key in sorted(states.tensors):
                ours, state_name = key.split(STATE_SEPARATOR)
                array = _their_layout(read(key, states.read(key)), ours, head)
                if state_name == MASTER_WEIGHT:
                    by_kind["master_weight"][f"{names[ours]}.{MASTER_SUFFIX}"] = array
                elif state_name in ADAM_STATES:
                    by_kind["optimizer_state"][f"{names[ours]}.{state_name}_0"] = array
                else:
                    raise CheckpointError(f"{key}: PaddleFormers' AdamW keeps no state {state_name!r}")
            for kind, arrays in by_kind.items():  # both, as PaddleFormers: its resume opens master_weight/ in fp32 too
                _save_kind(arrays, partial / kind)
                arrays.clear()
        fields = TRAINER_STATE_FIELDS | {"global_step": int(state["step"]),
                                         "consumed_samples": int(state.get("consumed_samples", 0)),
                                         "max_steps": int(state.get("max_steps", 0))}
        (partial / TRAINER_STATE_PICKLE).write_bytes(pickled_instance(*TRAINER_STATE_CLASS, fields))
        if state.get("lr_scheduler"):
            paddle.save(state["lr_scheduler"], str(partial / "scheduler.pdparams"))
        copy_tokenizer_files(source, partial)
    return Path(target)
