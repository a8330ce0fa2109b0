"""LoRA adapters in other programs' formats: written as a PEFT adapter folder, merged into a transformers
folder, and read from PEFT's or PaddleFormers' folders to start a run's adapters.

- PEFT (Hugging Face; vLLM and transformers load it): `adapter_config.json` + `adapter_model.safetensors`,
  `base_model.model.<transformers module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]: ours
  transposed, under the name transformers gives the projection's weight. The config's `target_modules`
  lists the adapted modules' whole paths, which PEFT matches exactly.
- PaddleFormers (and PaddleNLP): `lora_config.json` + `peft_model-0000k-of-0000n.safetensors` (or
  `lora_model_state.pdparams`-era names in safetensors), Paddle's names and layout (`<path>.lora_A`
  [in, r], `<path>.lora_B` [r, out]); a projection its model fuses (`qkv_proj`, `gate_up_fused_proj`)
  carries one A for the fused output and a B whose columns interleave ours, as the fused weight's do:
  each of ours takes the A and its columns of B (`modeling.paddlenlp_fused`).
- A merge writes W + scale x A B for every adapted projection, then the folder as `convert_hf.py
  export` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import new_folder
from checkpoint.format import CONFIG_FILE, MODEL, CheckpointError, read_index, require_our_layout
from checkpoint.shards import TensorSpec, write_shard
from checkpoint.unified_io import UnifiedReader
from modeling.lora import LORA_A, LORA_B, LoRA, adapted_paths
from modeling.paddlenlp_fused import fused_stored
from modeling.placement import TensorPlan
from modeling.registry import config_from_dict, plan_of
from modeling.transformers_adapter import Stored
from paddle_pp.interop.carried import carried_in
from paddle_pp.interop.transformers import _transformers_family, export_stored, hf_config, hf_locator

PEFT_CONFIG, PEFT_WEIGHTS, PEFT_PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."
PADDLEFORMERS_CONFIG = "lora_config.json"


class AdapterError(CheckpointError):
    """Adapters that cannot be written or read as asked."""


def _lora_checkpoint(folder: Path) -> tuple[dict, LoRA]:
    require_our_layout(read_index(folder, MODEL), folder)
    saved = json.loads((folder / CONFIG_FILE).read_text())
    lora = LoRA.of(config_from_dict(saved))
    if lora is None:
        raise AdapterError(f"{folder} holds no LoRA adapters (its config.json has no lora); export it with "
                           "tools/convert_hf.py export")
    return saved, lora


def base_config(saved: dict):
    """The config of the model a LoRA checkpoint adapts (config.json without its adapters)."""
    return config_from_dict({key: value for key, value in saved.items() if key != "lora"})


def _module(path: str, plan, locate: Callable[[str, TensorPlan], Stored]) -> str:
    """transformers' module of the projection at our `path`, from where `locate` stores its weight (refused
    when the weight is part of a fused tensor, one adapter per module there, or stored [in, out])."""
    stored = locate(f"{path}.weight", plan[f"{path}.weight"])
    if stored.fused or stored.stack is not None or not stored.name.endswith(".weight"):
        raise AdapterError(f"{path}: transformers stores this projection's weight inside {stored.name} with "
                           "others; a PEFT adapter of that module is not one of ours (not modelled)")
    if not stored.transposed:
        raise AdapterError(f"{path}: transformers stores this weight [in, out] (a Conv1D, GPT-2's); PEFT's "
                           "fan_in_fan_out adapters are not written (not modelled)")
    return stored.name.removesuffix(".weight")


def export_peft(folder: Path, target: Path, dtype: str = "float32", base_model: str | None = None) -> Path:
    """A PEFT adapter folder of a LoRA checkpoint's adapters."""
    folder = Path(folder)
    saved, lora = _lora_checkpoint(folder)
    config = config_from_dict(saved)
    plan, locate = plan_of(config), hf_locator(base_config(saved), carried_in(folder))
    unified = UnifiedReader(folder, MODEL)
    modules, tensors = [], {}
    for path in sorted(adapted_paths(plan)):
        module = _module(path, plan, locate)
        modules.append(module)
        for ours in (LORA_A, LORA_B):
            tensors[f"{PEFT_PREFIX}{module}.{ours}.weight"] = unified.read(f"{path}.{ours}").T.astype(dtype)
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                      "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "target_modules": modules,
                      "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                      "use_dora": False, "modules_to_save": None, "base_model_name_or_path": base_model}
    with new_folder(target) as partial:
        names = sorted(tensors)
        write_shard(partial / PEFT_WEIGHTS, [TensorSpec(n, tensors[n].dtype, tensors[n].shape) for n in names],
                    (np.ascontiguousarray(tensors[n]) for n in names), {"format": "pt"})
        (partial / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    return Path(target)


def merged_reader(read: Callable[[str], np.ndarray], plan, lora: LoRA) -> Callable[[str], np.ndarray]:
    """`read` of the adapted model's tensors with each adapted projection's weight merged: W + scale x A B."""
    adapted = adapted_paths(plan)

    def merged(name: str) -> np.ndarray:
        path = name.removesuffix(".weight")
        if path not in adapted or not name.endswith(".weight"):
            return read(name)
        update = read(f"{path}.{LORA_A}").astype(np.float64) @ read(f"{path}.{LORA_B}").astype(np.float64)
        return (read(name).astype(np.float64) + lora.scale * update).astype(np.float32)

    return merged


def export_merged(folder: Path, target: Path, max_shard_bytes: int = 5 << 30,
                  on_tensor: Callable[[str, int], None] | None = None, dtype: str = "float32") -> Path:
    """A transformers folder of a LoRA checkpoint's model with its adapters merged into the weights."""
    folder = Path(folder)
    saved, lora = _lora_checkpoint(folder)
    config, carried = base_config(saved), carried_in(folder)
    adapter = _transformers_family(saved, folder).transformers
    read = merged_reader(UnifiedReader(folder, MODEL).read, plan_of(config_from_dict(saved)), lora)
    return export_stored(folder, target, hf_locator(config, carried), hf_config(config, dtype, carried), "pt",
                         max_shard_bytes, on_tensor, dtype, adapter.stored_copies(config), carried,
                         plan=plan_of(config), read=read)


def adapter_arrays(folder: Path, config) -> tuple[LoRA, dict[str, np.ndarray]]:
    """(the adapters' settings, our single-card adapter tensors) of a PEFT or PaddleFormers adapter folder for
    a model of `config` (its `lora` giving the projections this run adapts): what --lora_path starts from."""
    folder = Path(folder)
    plan = plan_of(config)
    wanted = sorted(adapted_paths(plan))
    read = _peft if (folder / PEFT_CONFIG).is_file() else _paddleformers
    return adapter_settings(folder), read(folder, config, plan, wanted)


def _peft(folder: Path, config, plan, wanted: list[str]) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    stored = load_file(str(folder / PEFT_WEIGHTS))
    locate = hf_locator(base_config(config.to_dict()))
    arrays = {}
    for path in wanted:
        module = _module(path, plan, locate)
        for ours in (LORA_A, LORA_B):
            key = f"{PEFT_PREFIX}{module}.{ours}.weight"
            if key not in stored:
                raise AdapterError(f"{folder / PEFT_WEIGHTS} has no {key}, which this run's --lora_target_modules "
                                   "adapt; adapt the modules the folder holds")
            arrays[f"{path}.{ours}"] = stored[key].T
    return arrays


def adapter_settings(folder: Path) -> LoRA:
    """The rank, alpha, dropout and rsLoRA of a PEFT or PaddleFormers adapter folder (its targets: ours)."""
    for name, rslora in ((PEFT_CONFIG, "use_rslora"), (PADDLEFORMERS_CONFIG, "rslora")):
        if (Path(folder) / name).is_file():
            settings = json.loads((Path(folder) / name).read_text())
            return LoRA(int(settings["r"]), float(settings["lora_alpha"]), dropout=settings.get("lora_dropout", 0.0),
                        rslora=bool(settings.get(rslora, False)))
    raise AdapterError(f"--lora_path {folder} holds neither {PEFT_CONFIG} (PEFT) nor {PADDLEFORMERS_CONFIG} "
                       "(PaddleFormers)")


def _paddleformers(folder: Path, config, plan, wanted: list[str]) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    settings = json.loads((folder / PADDLEFORMERS_CONFIG).read_text())
    stored: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("peft_model*.safetensors")):
        stored |= load_file(str(path))
    if not stored:
        raise AdapterError(f"{folder} has no peft_model*.safetensors beside its {PADDLEFORMERS_CONFIG}")
    fused = frozenset(flag for flag in ("fuse_attention_qkv", "fuse_attention_ffn") if settings.get(flag)
                      or getattr(config, flag, False))
    locate = hf_locator(base_config(config.to_dict()))
    arrays = {}
    for path in wanted:
        row: TensorPlan = plan[f"{path}.weight"]
        # PaddleFormers 1.2 names modules as transformers does (model.layers...); PaddleNLP as we do (llama.layers...),
        # its fused projections as one module
        where = fused_stored(f"{path}.weight", row, config, fused) if fused else Stored(f"{path}.weight")
        modules = [where.name.removesuffix(".weight")] + ([] if fused else [locate(f"{path}.weight", row).name
                                                                            .removesuffix(".weight")])
        module = next((m for m in modules if f"{m}.{LORA_A}" in stored and f"{m}.{LORA_B}" in stored), None)
        if module is None:
            raise AdapterError(f"{folder} has no {' or '.join(modules)} lora_A / lora_B, which this run's "
                               "--lora_target_modules adapt; adapt the modules the folder holds")
        a, b = stored[f"{module}.{LORA_A}"], stored[f"{module}.{LORA_B}"]
        if where.fused:  # B's columns are the fused weight's output columns: ours taken as the weight's are
            b = where.select(b) if where.interleave is not None else np.split(b, where.parts, axis=1)[where.part]
        arrays[f"{path}.{LORA_A}"], arrays[f"{path}.{LORA_B}"] = a, b
    return arrays


def check_adapter_folder(folder: Path, config) -> None:
    """Before any process group: --lora_path's settings are the run's (its tensors are read at build)."""
    ours, theirs = LoRA.of(config), adapter_settings(folder)
    if ours is None:
        raise AdapterError(f"--lora_path {folder}: pass --lora (with the folder's rank and alpha) to train adapters")
    if (ours.rank, ours.alpha, ours.rslora) != (theirs.rank, theirs.alpha, theirs.rslora):
        raise AdapterError(f"--lora_path {folder} holds adapters of rank {theirs.rank}, alpha {theirs.alpha:g}"
                           f"{', rsLoRA' if theirs.rslora else ''}; the flags say rank {ours.rank}, alpha "
                           f"{ours.alpha:g}{', rsLoRA' if ours.rslora else ''}: pass the folder's")
