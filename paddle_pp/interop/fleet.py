"""Merging Paddle fleet's per-rank checkpoints into a unified one.

PaddleNLP's trainer without unified checkpoint (and any `paddle.save` of a fleet model's per-rank
`state_dict()`) leaves `model_state.tpXX_ppYY.pdparams` per (tp rank, stage) and
`optimizer.tpXX_ppYY[_shardZZ].pdopt` per (tp rank, stage, sharding rank). Model keys are already
single-card names with TP-local shapes; optimizer keys are Paddle's variable names
(`<param name>_moment1_0`), mapped back through the name table `paddle.save` stores beside the
weights. Each rank's files become one file of a pre-split copy, which `join_split` then streams
into the unified format. Pickles cannot be read in part, so peak memory is one rank's files (plus
one tensor), not the model.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import write_json_durably
from checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    TRAINER_STATE_FILE,
    CheckpointError,
    copy_tokenizer_files,
)
from checkpoint.optimizer_state import MASTER_WEIGHT, state_tp_axis
from checkpoint.piece import Piece
from checkpoint.save import model_metadata, single_card_config
from checkpoint.shards import TensorSpec, bf16_to_float32
from checkpoint.split import DEFAULT_SHARD_BYTES, SplitWriter, join_split, split_layout
from modeling.registry import load_config, plan_of
from paddle_pp.interop.pickled import NAME_TABLE, UnsafePickleError, load_pickled

RANK_FILE = re.compile(r"^(model_state|optimizer)(?:\.([a-z0-9_]+))?\.(pdparams|pdopt)$")
SCHEDULER_FILE = "scheduler.pdparams"
UNIQUE_SUFFIX = re.compile(r"_\d+$")
MASTER_SUFFIX = "fp32_master_0_"  # Paddle's `_gen_master_weight_var_name`: "<param>_fp32_master_0"


def _rank_of(suffix: str | None) -> tuple[int, int, int]:
    """(tp, pp, shard) from PaddleNLP's suffix, e.g. 'tp01_pp00_shard01'; absent parts are 0."""
    ranks = {"tp": 0, "pp": 0, "shard": 0}
    for part in suffix.split("_") if suffix else []:
        match = re.fullmatch(r"(tp|pp|shard)(\d+)", part)
        if match is None:
            raise CheckpointError(f"cannot read the rank suffix {suffix!r} (expected tpXX, ppYY, shardZZ parts)")
        ranks[match.group(1)] = int(match.group(2))
    return ranks["tp"], ranks["pp"], ranks["shard"]


def find_rank_files(folder: Path) -> tuple[int, int, dict, dict]:
    """(tp degree, pp degree, {(tp, pp): model file}, {(tp, pp): [optimizer files by sharding rank]});
    the grid of ranks must be whole."""
    models, optimizers = {}, defaultdict(list)
    for path in sorted(Path(folder).iterdir()):
        match = RANK_FILE.match(path.name)
        if match is None:
            continue
        tp, pp, shard = _rank_of(match.group(2))
        if match.group(1) == "model_state":
            models[(tp, pp)] = path
        else:
            optimizers[(tp, pp)].append((shard, path))
    if not models:
        raise CheckpointError(f"{folder} holds no model_state*.pdparams: not a fleet per-rank checkpoint")
    tp, pp = max(t for t, _ in models) + 1, max(p for _, p in models) + 1
    missing = [f"tp{t:02d}_pp{p:02d}" for t in range(tp) for p in range(pp) if (t, p) not in models]
    if missing:
        raise CheckpointError(f"{folder} lacks model_state files for ranks {missing}: the checkpoint is incomplete")
    if optimizers and set(optimizers) != set(models):
        raise CheckpointError(f"{folder} has optimizer files for {sorted(optimizers)} but weights for "
                              f"{sorted(models)}; the checkpoint is incomplete")
    return tp, pp, models, {key: [p for _, p in sorted(files)] for key, files in optimizers.items()}


def _as_float32(array: np.ndarray) -> np.ndarray:
    """Weights as float32; `paddle.save` stores bfloat16 as its raw uint16 bits."""
    return bf16_to_float32(array) if array.dtype == np.uint16 else array.astype(np.float32, copy=False)


def _state_key(var_name: str, structured: dict[str, str]) -> str:
    """'<param name>_<state>_<n>' -> '<structured name>/<state>'. Under mixed precision Paddle names
    the states after the parameter's master weight, '<param name>_fp32_master_0_<state>_<n>'."""
    base = UNIQUE_SUFFIX.sub("", var_name)
    owners = [p for p in structured if base.startswith(p + "_")]
    if not owners:
        raise CheckpointError(f"optimizer variable {var_name!r} belongs to no parameter of the weights file")
    owner = max(owners, key=len)
    return f"{structured[owner]}{STATE_SEPARATOR}{base[len(owner) + 1:].removeprefix(MASTER_SUFFIX)}"


def _unified_meta(array: np.ndarray, piece: Piece) -> dict:
    """The unified index's entry of a tensor whose `piece` is `array`."""
    return {"dtype": str(array.dtype), "shape": piece.full_shape(array.shape), "tp_axis": piece.axis}


def _load(path: Path, allow_unsafe_pickle: bool) -> dict:
    try:
        return load_pickled(path, allow_unsafe_pickle, keep_name_table=True)
    except UnsafePickleError:
        raise
    except Exception as err:  # pickle and Paddle raise many kinds for a torn file
        raise CheckpointError(f"{path} cannot be read ({err}); it is truncated or not a paddle.save file") from err


def write_rank_arrays(writer: SplitWriter, kind: str, tp_rank: int, stage: int, arrays: dict[str, np.ndarray],
                      axes: Callable[[str, np.ndarray], int | None], tp: int) -> None:
    """One (tp rank, stage)'s `arrays` of `kind` into a split copy; `axes(name, array)` their tp axis."""
    names = sorted(arrays)
    full = {n: _unified_meta(arrays[n], Piece(axes(n, arrays[n]), tp, tp_rank)) for n in names}
    specs = [TensorSpec(n, arrays[n].dtype, tuple(arrays[n].shape)) for n in names]
    writer.write(kind, tp_rank, stage, specs, (arrays[n] for n in names), full)


def _optimizer_arrays(files: list[Path], table: dict[str, str], allow_unsafe_pickle: bool) -> dict[str, np.ndarray]:
    structured = {param: name for name, param in table.items()}
    arrays = {}
    for path in files:
        state = _load(path, allow_unsafe_pickle)
        for param, master in state.pop("master_weights", {}).items():
            arrays[f"{structured[param]}{STATE_SEPARATOR}{MASTER_WEIGHT}"] = np.asarray(master)
        for var_name, value in state.items():
            if isinstance(value, np.ndarray):
                arrays[_state_key(var_name, structured)] = value
    return arrays


def scheduler_state(source: Path, optimizer_files: dict, allow_unsafe_pickle: bool) -> dict:
    """The learning-rate schedule's state: `scheduler.pdparams` in `source`, else the one PaddleNLP
    keeps in its optimizer files, else none."""
    if (source / SCHEDULER_FILE).is_file():
        state = _load(source / SCHEDULER_FILE, allow_unsafe_pickle)
    elif optimizer_files:
        state = _load(next(iter(optimizer_files.values()))[0], allow_unsafe_pickle).get("LR_Scheduler", {})
    else:
        state = {}
    return json.loads(json.dumps(state, default=float))


def _merge_rank(writer: SplitWriter, tp_rank: int, stage: int, model_file: Path, optimizer_files: list[Path],
                param_axes: dict, tp: int, allow_unsafe_pickle: bool) -> None:
    """One (tp rank, stage): its weights and its optimizer states (all sharding ranks) as split files."""
    state = _load(model_file, allow_unsafe_pickle)
    table = state.pop(NAME_TABLE, None)
    weights = {n: _as_float32(v) for n, v in state.items() if isinstance(v, np.ndarray)}
    write_rank_arrays(writer, MODEL, tp_rank, stage, weights, lambda n, a: param_axes.get(n), tp)
    if not optimizer_files:
        return
    if table is None:
        raise CheckpointError(f"{model_file} has no parameter name table: save it with paddle.save(state_dict) so "
                              "optimizer states can be matched to their parameters")

    def axis(key: str, array: np.ndarray) -> int | None:
        param = key.split(STATE_SEPARATOR)[0]
        return state_tp_axis(array.shape, weights[param].shape, param_axes.get(param))

    write_rank_arrays(writer, OPTIMIZER, tp_rank, stage, _optimizer_arrays(optimizer_files, table, allow_unsafe_pickle), axis, tp)


def merge_fleet(source: Path, target: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                on_tensor: Callable[[str, int], None] | None = None, allow_unsafe_pickle: bool = False) -> Path:
    """Turn fleet's per-rank files in `source` (with its `config.json` and PaddleNLP's
    `trainer_state.json`) into a unified checkpoint at `target`. The pickled files are read as data
    only (`pickled.load_pickled`) unless `allow_unsafe_pickle`."""
    source, target = Path(source), Path(target)
    if not (source / CONFIG_FILE).is_file():
        raise CheckpointError(f"{source / CONFIG_FILE} is missing: the merge needs the model config to know "
                              "how tensors split; copy the run's config.json there")
    config = load_config(source)
    plan = plan_of(config)
    tp, pp, models, optimizers = find_rank_files(source)
    param_axes = plan.axes()

    def write(writer: SplitWriter) -> None:
        for (tp_rank, stage), path in sorted(models.items()):
            _merge_rank(writer, tp_rank, stage, path, optimizers.get((tp_rank, stage), []), param_axes, tp,
                        allow_unsafe_pickle)

    return write_unified(target, config, plan, (tp, pp), write, _trainer_state(source, optimizers, allow_unsafe_pickle),
                         source, max_shard_bytes, on_tensor)


def write_unified(target: Path, config, plan, degrees: tuple[int, int], write: Callable[[SplitWriter], None],
                  trainer_state: dict, tokenizer_folder: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """A unified checkpoint at `target` from what `write` puts into a split copy for (tp, pp) `degrees`,
    staged beside it, with the model's config, `trainer_state` and the tokenizer files of
    `tokenizer_folder`: how other frameworks' checkpoints come in."""
    staging = target.with_name(target.name + ".split.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        writer = SplitWriter(staging, split_layout(*degrees, 1))
        write(writer)
        writer.finish(model_metadata(plan))
        write_json_durably(staging / CONFIG_FILE, single_card_config(config, plan))
        write_json_durably(staging / TRAINER_STATE_FILE, trainer_state)
        copy_tokenizer_files(tokenizer_folder, staging)
        return join_split(staging, target, max_shard_bytes, on_tensor)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _trainer_state(source: Path, optimizers: dict, allow_unsafe_pickle: bool) -> dict:
    """Our trainer state from PaddleNLP's `trainer_state.json` (global_step, consumed_samples)."""
    path = source / TRAINER_STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the merge needs the step and consumed samples to resume")
    theirs = json.loads(path.read_text())
    return {"format_version": FORMAT_VERSION, "step": theirs["global_step"],
            "consumed_samples": theirs.get("consumed_samples", 0), "lr_scheduler": scheduler_state(source, optimizers, allow_unsafe_pickle),
            "merged_from": str(source)}
