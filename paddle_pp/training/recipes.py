"""Recipe files read as this trainer's flags: PaddleNLP's pretraining argument files
(`run_pretrain.py recipe.json [--flag value ...]`, or `--config recipe.json`, as PaddleNLP's
llm/run_pretrain.py takes them) and PaddleFormers' (`--config recipe.yaml` with `stage: PT`; its
dialect in `paddleformers_recipes.py`).

A recipe means what its library would do with it, so a field it leaves out takes that library's
default, not ours (PaddleNLP's linear decay, its learning rates, its batch sizes, GPT's dropout of
0.1, resuming the newest checkpoint in output_dir). Every field is one of: a flag of ours (under its name or a
renamed one), on the short list of fields that change nothing that is trained (`NO_EFFECT`, each
with its reason), a communication-option string whose every option is known to change nothing, or
refused by name with the fix (`REFUSED`, and any field this file does not know).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from paddle_pp.runtime.errors import UserError


class RecipeError(UserError, ValueError):
    """A recipe file that cannot be read, or asks for training this trainer does not do."""


RENAMED = {"tokenizer_name_or_path": "tokenizer_dir", "disable_tqdm": "disable_progress_bar"}

# PaddleNLP's defaults (TrainingArguments, and llm/run_pretrain.py's own) where ours differ.
PADDLENLP_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-5, "min_learning_rate": 1e-5, "warmup_steps": 0, "lr_scheduler_type": "linear",
    "weight_decay": 0.0, "adam_beta2": 0.999, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "max_seq_length": 1024, "logging_steps": 500, "save_steps": 500, "continue_training": False,
    "use_flash_attention": False, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "eval_iters": 10,  # run_pretrain.py sets 10 whatever the file says
}

_KERNELS = "a kernel or parameter-layout choice with the same arithmetic"
NO_EFFECT = {  # field: why it changes nothing that is trained here
    **dict.fromkeys(("use_fast_layer_norm", "use_fused_linear", "use_fused_dropout_add",
                     "use_fused_linear_cross_entropy", "tensor_parallel_output"), _KERNELS),
    "enable_linear_fused_grad_add": f"{_KERNELS} (--amp_master_grad accumulates into fp32 main_grad either way)",
    **dict.fromkeys(("fuse_attention_qkv", "fuse_attention_ffn"),
                    f"{_KERNELS}; parameters are kept per projection here, and folders with fused ones are read"),
    **dict.fromkeys(("sharding_comm_buffer_size_MB", "fuse_sequence_parallel_allreduce"),
                    "communication scheduling"),
    **dict.fromkeys(("dataloader_num_workers", "distributed_dataloader", "skip_warmup", "share_folder",
                     "skip_profile_timer", "autotuner_benchmark", "device", "do_train", "do_predict",
                     "test_iters", "per_device_eval_batch_size", "evaluation_strategy", "save_strategy",
                     "logging_strategy", "unified_checkpoint", "num_train_epochs"),
                    "I/O, device or bookkeeping (checkpoints are always unified; steps are set by max_steps, "
                    "evaluation by eval_steps and eval_iters on the training batch size)"),
    "use_expert_parallel": "a switch: experts are split whenever expert_parallel_degree > 1",
}

# The options of PaddleNLP's three *_parallel_config strings that schedule communication or pick
# kernels and change nothing that is trained; another option is refused by name.
COMMUNICATION_OPTIONS = {
    "pipeline_parallel_config": {"enable_delay_scale_loss", "enable_release_grads", "disable_partial_send_recv",
                                 "disable_batch_p2p_comm", "enable_sharding_comm_overlap", "enable_dp_comm_overlap",
                                 "disable_p2p_cache_shape", "enable_timer", "enable_overlap_p2p_comm",
                                 "enable_clear_every_step_cache", "enable_offload_queue",
                                 "enable_dynamic_shape"},  # shapes sent each step: rows here are one length
    "tensor_parallel_config": {"enable_delay_scale_loss", "enable_mp_async_allreduce", "enable_mp_skip_c_identity",
                               "enable_mp_fused_linear_param_grad_add", "enable_sp_async_reduce_scatter",
                               "sync_param", "sync_grad", "sync_moment", "enable_mp_allreduce_overlap"},
    "sharding_parallel_config": {"split_param", "enable_stage1_overlap", "enable_stage1_allgather_overlap",
                                 "enable_stage1_broadcast_overlap", "enable_stage2_overlap",
                                 "enable_stage1_tensor_fusion", "enable_release_grads", "disable_stage1_reduce_avg",
                                 "enable_overlap"},
}

# Options of pipeline_parallel_config that pick fleet's schedule class: the flag and value they mean.
SCHEDULE_OPTIONS = {"use_dualpipev": ("pipeline_schedule", "DualPipeV")}

REFUSED: dict[str, tuple[Callable[[dict], bool], str]] = {  # field: (is its value trainable here?, why not, fix)
    "decay_steps": (lambda v: v["decay_steps"] in (None, v.get("max_steps")),
                    "the decay always ends at max_steps; drop decay_steps or set it to max_steps"),
    "max_steps": (lambda v: v["max_steps"] > 0, "pretraining runs a set number of steps; set max_steps > 0"),
    "fp16_opt_level": (lambda v: v["fp16_opt_level"] == "O2",
                       "only AMP O2 (bf16/fp16 parameters, fp32 masters) is modelled; use O2"),
    "no_recompute_layers": (lambda v: not v["no_recompute_layers"],
                            "every layer is recomputed alike here; drop no_recompute_layers"),
    "refined_recompute": (lambda v: not v["refined_recompute"],
                          "refined recompute is not modelled; use recompute_granularity instead"),
    "unified_checkpoint_config": (lambda v: not v["unified_checkpoint_config"],
                                  "checkpoint options are not modelled (async saves: --async_save); drop them"),
}


def _refusals(values: dict, refused_fields: dict) -> list[str]:
    """Fields whose value would train something else than this trainer can, with the fix."""
    refused = [f"{key}={values[key]!r} ({why})" for key, (trainable, why) in refused_fields.items()
               if key in values and not trainable(values)]
    for key, allowed in COMMUNICATION_OPTIONS.items():
        unknown = sorted(set(str(values.get(key) or "").split()) - allowed - set(SCHEDULE_OPTIONS))
        if unknown:
            refused.append(f"{key} option(s) {', '.join(unknown)} (not known to change nothing that is trained; "
                           f"known: {', '.join(sorted(allowed))})")
    return refused


@dataclass(frozen=True)
class Dialect:
    """How one library's recipe fields read as this trainer's flags: renamed fields, its defaults
    where ours differ, fields that change nothing trained, fields refused for some values, and
    `prepare`, which reads the fields that need more than a rename (their flags, the fields it
    consumed, refusals)."""

    library: str
    possessive: str  # "PaddleNLP's", "PaddleFormers'"
    renamed: dict[str, str]
    defaults: dict[str, Any]
    no_effect: dict[str, str]
    refused: dict[str, tuple[Callable[[dict], bool], str]]
    prepare: Callable[[dict], tuple[dict[str, Any], set[str], list[str]]] = lambda values: ({}, set(), [])


def schedule_options(values: dict) -> dict[str, Any]:
    """The flags PaddleNLP's pipeline_parallel_config options that pick a schedule mean (`use_dualpipev`)."""
    words = str(values.get("pipeline_parallel_config") or "").split()
    return dict(flag for option, flag in SCHEDULE_OPTIONS.items() if option in words)


PADDLENLP = Dialect("PaddleNLP", "PaddleNLP's", RENAMED, PADDLENLP_DEFAULTS, NO_EFFECT, REFUSED,
                    lambda values: (schedule_options(values), set(), []))


def load_recipe(path: Path) -> dict[str, Any]:
    """A recipe file's fields (JSON, or YAML as PaddleFormers writes them)."""
    try:
        text = Path(path).read_text()
        values = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except (OSError, json.JSONDecodeError, yaml.YAMLError) as err:
        raise RecipeError(f"cannot read the recipe {path}: {err}") from err
    if not isinstance(values, dict):
        raise RecipeError(f"{path} is not a mapping of argument: value")
    return values


def read_recipe(path: Path, known: set[str], booleans: set[str], values: dict[str, Any] | None = None,
                dialect: Dialect = PADDLENLP) -> tuple[dict[str, Any], list[str]]:
    """(flag defaults from the recipe, notes to show: fields without effect and the library's
    defaults applied). `known`: our flags' names; `booleans`: those that are booleans (recipes write
    0/1); `values`: the file's fields when already read; `dialect`: whose recipe it is."""
    values = load_recipe(path) if values is None else values
    flags, consumed, refused = dialect.prepare(values)
    refused += _refusals(values, dialect.refused)
    without_effect: dict[str, list[str]] = {}  # reason -> fields
    for key, value in values.items():
        dest = dialect.renamed.get(key, key)
        if key in consumed:
            continue
        if key in dialect.no_effect:
            without_effect.setdefault(dialect.no_effect[key], []).append(key)
        elif dest in known:
            flags[dest] = bool(value) if dest in booleans else value
        elif key not in dialect.refused and key not in COMMUNICATION_OPTIONS and key != "overwrite_output_dir":
            refused.append(f"{key}={value!r} (a field paddle-pp does not know: it may change what is trained; "
                           "remove it, or see docs/models.md's list of recipe fields)")
    if refused:
        raise RecipeError(f"{path} ({dialect.library} recipe) asks for what paddle-pp cannot honour: "
                          f"{'; '.join(refused)}")
    if flags.get("report_to") == "all":
        flags["report_to"] = "visualdl"
    if flags.get("expert_parallel_degree") in (None, -1):  # PaddleNLP's "unset"
        flags.pop("expert_parallel_degree", None)
    if "sharding" in flags and "sharding_parallel_degree" not in flags:
        flags["sharding_parallel_degree"] = -1  # PaddleNLP's default: every data-parallel rank
    if "eval_steps" not in flags:  # transformers' rule, which PaddleNLP follows
        flags["eval_steps"] = flags.get("logging_steps", dialect.defaults["logging_steps"])
    if "resume_from_checkpoint" not in flags and not values.get("overwrite_output_dir"):
        flags["resume_from_checkpoint"] = "latest"  # run_pretrain.py resumes output_dir's newest checkpoint
    defaults = {k: v for k, v in dialect.defaults.items() if k not in flags or k == "eval_iters"}
    grouped = "; ".join(f"{', '.join(keys)} ({why})" for why, keys in without_effect.items())
    notes = [f"changing nothing that is trained: {grouped}"] if without_effect else []
    notes += [f"{dialect.possessive} defaults for fields the recipe leaves out: "
              f"{', '.join(f'{k}={v}' for k, v in defaults.items())}"] if defaults else []
    if flags.get("resume_from_checkpoint") == "latest" and "resume_from_checkpoint" not in values:
        notes.append(f"resumes output_dir's newest checkpoint if there is one, as {dialect.possessive} trainer does "
                     "(overwrite_output_dir: true starts over)")
    return flags | defaults, notes
