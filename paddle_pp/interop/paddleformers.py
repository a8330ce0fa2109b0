"""A PaddleFormers 1.2 training checkpoint in its default flex format turned into a unified one,
which this trainer resumes under any layout (`tools/reshard.py flex`).

What PaddleFormers writes (`trainer.py` `_save_flex_model_state` / `_save_flex_optimizer_state`):
`model_state/` with a plain family's tensors under transformers' names (`model.layers.0.self_attn.
q_proj.weight`) in Paddle's [in, out] layout for linears, the head as transformers keeps it ([vocab,
hidden]); `optimizer_state/` with AdamW's `<name>.moment1_0`, `.moment2_0`, `.beta1_pow_acc_0`,
`.beta2_pow_acc_0`; `master_weight/` with fp32 masters `<name>.w_0` under mixed precision (empty in
fp32); `trainer_state.bin` (a pickled TrainerState: global_step, consumed_samples) and
`scheduler.pdparams`. Each tensor is taken whole from its pieces (`interop/flex.py`) and placed by
its shape: as ours, or transposed where only the transpose fits (the head). A flex checkpoint has no
config.json: the model's comes from the folder the run started from (`model_folder`), which also
gives the tokenizer. Families PaddleFormers fuses internally (ERNIE 4.5's qkv_proj, Gemma 3's
up_gate_proj) are refused by the names they lack.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from checkpoint.format import FORMAT_VERSION, MODEL, OPTIMIZER, STATE_SEPARATOR, CheckpointError
from checkpoint.optimizer_state import MASTER_WEIGHT
from checkpoint.split import DEFAULT_SHARD_BYTES
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.fleet import scheduler_state, write_rank_arrays, write_unified
from paddle_pp.interop.flex import FlexFolder, flex_parts
from paddle_pp.interop.pickled import load_pickled_record
from paddle_pp.interop.pretrained import open_pretrained

ADAM_STATES = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")  # Paddle AdamW's accumulators, `_0` on disk
MASTER_SUFFIX = "w_0"
TRAINER_STATE_BIN = "trainer_state.bin"
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
    path = source / TRAINER_STATE_BIN
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the import needs the step and consumed samples to resume")
    theirs = load_pickled_record(path, {TRAINER_STATE_CLASS: SimpleNamespace})
    if not hasattr(theirs, "global_step"):
        raise CheckpointError(f"{path} is not PaddleFormers' TrainerState")
    return {"format_version": FORMAT_VERSION, "step": int(theirs.global_step),
            "consumed_samples": int(getattr(theirs, "consumed_samples", 0)),
            "lr_scheduler": scheduler_state(source, {}, False), "imported_from": str(source)}


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

    def write(writer) -> None:
        write_rank_arrays(writer, MODEL, 0, 0, weights, lambda name, array: None, 1)
        states = _states(parts, names, weights)
        if states:
            write_rank_arrays(writer, OPTIMIZER, 0, 0, states, lambda name, array: None, 1)

    return write_unified(Path(target), config, plan, (1, 1), write, _trainer_state(source), model_folder,
                         max_shard_bytes, on_tensor)
