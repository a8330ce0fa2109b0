"""PaddleNLP pretraining argument files (`run_pretrain.py recipe.json [--flag value ...]`, as
PaddleNLP's llm/run_pretrain.py takes them) read as this trainer's flags.

A recipe means what PaddleNLP would do with it, so a field it leaves out takes PaddleNLP's
default, not ours (its linear decay, its learning rates, its batch sizes); fields that only pick
kernels or I/O are named and ignored; a value that would train something else than PaddleNLP
trains is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from paddle_pp.runtime.errors import UserError


class RecipeError(UserError, ValueError):
    """A recipe file that cannot be read, or asks for training this trainer does not do."""


RENAMED = {"tokenizer_name_or_path": "tokenizer_dir", "disable_tqdm": "disable_progress_bar"}

# PaddleNLP's defaults (TrainingArguments, and llm/run_pretrain.py's own) where ours differ.
PADDLENLP_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-5, "min_learning_rate": 1e-5, "warmup_steps": 0, "lr_scheduler_type": "linear",
    "weight_decay": 0.0, "adam_beta2": 0.999, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "max_seq_length": 1024, "logging_steps": 500, "save_steps": 500, "continue_training": False,
    "eval_iters": 10,  # run_pretrain.py sets 10 whatever the file says
}

NO_EFFECT = {  # field: why it changes nothing that is trained here
    **dict.fromkeys(("use_flash_attention", "use_fused_rms_norm", "use_fused_rope", "use_fast_layer_norm",
                     "use_fused_linear", "use_fused_dropout_add", "use_fused_linear_cross_entropy",
                     "enable_linear_fused_grad_add", "fuse_attention_qkv", "fuse_attention_ffn",
                     "tensor_parallel_output"), "a kernel or fusion choice; the same arithmetic"),
    **dict.fromkeys(("pipeline_parallel_config", "tensor_parallel_config", "sharding_parallel_config",
                     "sharding_comm_buffer_size_MB", "fuse_sequence_parallel_allreduce"),
                    "communication scheduling options"),
    **dict.fromkeys(("dataloader_num_workers", "distributed_dataloader", "skip_warmup", "share_folder",
                     "skip_profile_timer", "autotuner_benchmark", "device", "overwrite_output_dir",
                     "per_device_eval_batch_size", "do_train", "do_eval", "do_predict", "num_train_epochs",
                     "evaluation_strategy", "save_strategy", "logging_strategy", "test_iters"),
                    "I/O, device or bookkeeping; steps are set by max_steps, evaluation by eval_steps"),
    "unified_checkpoint": "checkpoints are always unified here",
    "unified_checkpoint_config": "checkpoints are always unified here",
    "fp16_opt_level": "fp32 master weights are always kept (O2's choice)",
}


CHECKED: dict[str, tuple[Callable[[dict], bool], str]] = {  # field: (is its value trainable here?, why not)
    "recompute_granularity": (lambda v: v["recompute_granularity"] == "full",
                              "only full-layer recompute is implemented"),
    "decay_steps": (lambda v: v["decay_steps"] in (None, v.get("max_steps")), "the decay always ends at max_steps"),
    "hidden_dropout_prob": (lambda v: not v["hidden_dropout_prob"], "no dropout is modelled"),
    "attention_probs_dropout_prob": (lambda v: not v["attention_probs_dropout_prob"], "no dropout is modelled"),
    "max_steps": (lambda v: v["max_steps"] > 0, "pretraining runs a set number of steps"),
}


def _refusals(values: dict) -> list[str]:
    """Fields whose value would train something else than this trainer can."""
    return [f"{key}={values[key]!r} ({why})" for key, (trainable, why) in CHECKED.items()
            if key in values and not trainable(values)]


def read_recipe(path: Path, known: set[str], booleans: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(flag defaults from the recipe, notes to show: fields ignored and PaddleNLP defaults applied)."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecipeError(f"cannot read the recipe {path}: {err}") from err
    if not isinstance(values, dict):
        raise RecipeError(f"{path} is not a JSON object of argument: value")
    refused = _refusals(values)
    if refused:
        raise RecipeError(f"{path} asks for what paddle-pp cannot honour: {'; '.join(refused)}")
    flags: dict[str, Any] = {}
    ignored = []
    for key, value in values.items():
        dest = RENAMED.get(key, key)
        if key in NO_EFFECT:
            ignored.append(f"{key} ({NO_EFFECT[key]})")
        elif dest in known:
            flags[dest] = bool(value) if dest in booleans else value
        elif key not in CHECKED:
            ignored.append(f"{key} (unknown to paddle-pp)")
    if flags.get("report_to") == "all":
        flags["report_to"] = "visualdl"
    if "sharding" in flags and "sharding_parallel_degree" not in flags:
        flags["sharding_parallel_degree"] = -1  # PaddleNLP's default: every data-parallel rank
    if "eval_steps" not in flags:  # transformers' rule, which PaddleNLP follows
        flags["eval_steps"] = flags.get("logging_steps", PADDLENLP_DEFAULTS["logging_steps"])
    defaults = {k: v for k, v in PADDLENLP_DEFAULTS.items() if k not in flags or k == "eval_iters"}
    notes = [f"ignored: {', '.join(ignored)}"] if ignored else []
    notes += [f"PaddleNLP's defaults for fields the recipe leaves out: "
              f"{', '.join(f'{k}={v}' for k, v in defaults.items())}"] if defaults else []
    return flags | defaults, notes
