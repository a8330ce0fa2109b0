"""Offline check of a checkpoint folder: every file present, unaltered, and consistent."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from checkpoint.format import (
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    CheckpointError,
    index_name,
    read_index,
    weights_layout,
)
from checkpoint.shards import ShardReader, file_checksum, recorded_checksum
from modeling.placement import ModelPlan


def verify_checkpoint(folder: Path, plan_of_folder: Callable[[Path], ModelPlan] | None = None,
                      on_file: Callable[[str, int], None] | None = None) -> list[str]:
    """Problems found (empty when the checkpoint is sound): missing or altered files, tensors the
    index lists but a shard lacks, optimizer states of parameters the model does not have, and with
    `plan_of_folder` (the model a folder's config.json describes: `modeling.registry.plan_of_folder`)
    weights missing from or shaped unlike that model. `on_file(name, bytes)` is called as each file
    is hashed (the long part, for a progress bar). Weights in transformers' layout (`--save_to_hf`)
    are under transformers' names: the optimizer's keys are then checked against the plan's names,
    and their names and shapes are the reader's to check (`pretrained.open_pretrained`)."""
    folder = Path(folder)
    ours = weights_layout(folder) is None
    problems: list[str] = _against_config(folder, plan_of_folder) if plan_of_folder and ours else []
    model_names: set[str] | None = set()
    for kind in (MODEL, OPTIMIZER):
        if kind == OPTIMIZER and not (folder / index_name(kind)).is_file():
            continue
        try:
            index = read_index(folder, kind)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        meta = index["metadata"]
        for fname, expected in sorted(meta["files"].items()):
            path = folder / fname
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            if path.stat().st_size != expected["size"]:
                problems.append(f"{path}: {path.stat().st_size} bytes, index says {expected['size']} (truncated)")
                continue
            algorithm, recorded = recorded_checksum(expected)
            digest = file_checksum(path, algorithm)
            if on_file:
                on_file(fname, expected["size"])
            if digest != recorded:
                problems.append(f"{path}: {algorithm} checksum mismatch (corrupted)")
                continue
            try:
                held = ShardReader(path).names
            except CheckpointError as err:
                problems.append(str(err))
                continue
            listed = {n for n, f in index["weight_map"].items() if f == fname}
            if listed - held:
                problems.append(f"{path}: lacks {sorted(listed - held)[:3]} listed in {index_name(kind)}")
        names = set(index["weight_map"])
        if kind == MODEL:
            model_names = names if ours else set(plan_of_folder(folder)) if plan_of_folder else None
        elif model_names is not None:
            orphans = sorted({n.split(STATE_SEPARATOR)[0] for n in names} - model_names)
            if orphans:
                problems.append(f"optimizer states for parameters the model lacks: {orphans[:3]}")
    return problems


def _against_config(folder: Path, plan_of_folder: Callable[[Path], ModelPlan]) -> list[str]:
    """The model index against what `config.json` implies: single-card names, shapes and tp axes."""
    try:
        plan = plan_of_folder(folder)
        tensors = read_index(folder, MODEL)["metadata"]["tensors"]
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as err:
        return [f"{folder}: cannot compare with config.json ({err})"]
    expected = {name: list(row.shape) for name, row in plan.items()}
    problems = [f"{name}: missing; config.json describes it with shape {shape}"
                for name, shape in sorted(expected.items()) if name not in tensors]
    problems += [f"{name}: shape {tensors[name]['shape']}, config.json implies {shape}"
                 for name, shape in sorted(expected.items()) if name in tensors and tensors[name]["shape"] != shape]
    problems += [f"{name}: not a parameter of the model config.json describes" for name in sorted(set(tensors) - set(expected))]
    axes = plan.axes()  # a wrong recorded axis would split the tensor wrongly (`reshard split`)
    problems += [f"{name}: index records tp axis {tensors[name].get('tp_axis')}, the model splits it on {axes[name]}"
                 for name in sorted(set(tensors) & set(expected)) if tensors[name].get("tp_axis") != axes[name]]
    return problems
