"""PaddleFormers 1.2 pretraining recipes (`stage: PT`, as its examples/config/pt/*.yaml write them)
read as this trainer's flags: the PaddleFormers dialect of `recipes.py`.

What differs from a PaddleNLP recipe, each read with PaddleFormers' meaning:
- degree names: `*_model_parallel_size`, `sharding_parallel_size` (alias `sharding_degree`),
  `context_parallel_size`; the older spellings of the 1.x line (`tensor_parallel_degree`, ...) are
  read too, and a recipe giving two spellings of one degree is refused; -1 (PaddleFormers' default)
  is 1, and sharding (stage1 unless the recipe says otherwise) spans every data-parallel rank;
- data: `max_seq_len`; offline data as `dataset_type: pretrain` with `input_dir` weight/prefix pairs
  and `split` (the indexed files and the sampling PaddleNLP's pretraining also reads); PaddleFormers'
  online jsonl datasets are refused with the command that prepares them;
- `stage: PT` with `fine_tuning: full` (the defaults SFT and LoRA are other training, refused);
- attention per document unless `use_global_causal_attn` (default false); positions restart at every
  document either way, as PaddleFormers' collator restarts them (true: `--reset_position_ids`);
  `_attn_implementation` picks the core (flashmask and sdpa: flash where it applies, eager: dense);
- the schedule as its Trainer's: warmup from 0 (peak x step / warmup, `--warmup_from_zero`), `min_lr`
  read by cosine only (its linear decays to 0: a recipe giving both is refused);
- recompute: `recompute_granularity: full` with `recompute_method: uniform` and
  `recompute_num_layers: 1` (what PaddleFormers' decoder layers test for) recomputes each layer;
- the flat communication booleans that replaced PaddleNLP's `*_parallel_config` strings, and the
  checkpoint format fields (checkpoints here are unified ones), change nothing trained.
"""

from __future__ import annotations

from typing import Any

from paddle_pp.training.recipes import NO_EFFECT, REFUSED, RENAMED, Dialect

# our flag -> its PaddleFormers spellings, the current one first
DEGREES = {
    "tensor_parallel_degree": ("tensor_model_parallel_size", "tensor_parallel_degree"),
    "pipeline_parallel_degree": ("pipeline_model_parallel_size", "pipeline_parallel_degree"),
    "sharding_parallel_degree": ("sharding_parallel_size", "sharding_degree", "sharding_parallel_degree"),
    "context_parallel_degree": ("context_parallel_size", "context_parallel_degree"),
    "expert_parallel_degree": ("expert_model_parallel_size", "expert_parallel_degree"),
    "virtual_pp_degree": ("virtual_pipeline_model_parallel_size", "virtual_pp_degree"),
}
UNBUILT_DEGREES = {  # degrees > 1 of axes this trainer does not build
    "sep_parallel_size": "Ulysses sequence parallelism is not built; use context_parallel_size (ring attention)",
    "expert_tensor_model_parallel_size": "experts are not split over tp ranks here; drop it",
}

# PaddleFormers' TrainingArguments, DataArguments and ModelArguments defaults where ours differ
PADDLEFORMERS_DEFAULTS: dict[str, Any] = {
    "learning_rate": 5e-5, "min_learning_rate": 0.0, "warmup_steps": 0, "lr_scheduler_type": "linear",
    "weight_decay": 0.0, "adam_beta2": 0.999, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "max_seq_length": 4096, "split": "950,50", "logging_steps": 500, "save_steps": 500, "do_eval": False,
    "sharding": "stage1", "hybrid_parallel_topo_order": "sharding_first", "moe_router_bias_update_rate": 0.0,
    "use_flash_attention": True, "use_global_causal_attn": False, "sharding_parallel_degree": -1,
    "warmup_from_zero": True,
}

_COMMUNICATION = "communication scheduling (PaddleFormers' flat form of a *_parallel_config option)"
_ONLINE_ONLY = "shapes PaddleFormers' online jsonl datasets only; offline indexed data is packed by its sample index"
PADDLEFORMERS_NO_EFFECT = {
    **NO_EFFECT,
    **dict.fromkeys(("split_param", "tp_sync_param", "tp_sync_moment", "sync_grad", "partial_send_recv",
                     "batch_p2p_comm", "clear_every_step_cache", "overlap_p2p_comm", "release_grads",
                     "pp_delay_scale_loss", "dp_allreduce_avg_in_gradinent_scale", "gradient_sync_after_accumulate",
                     "moe_token_dispatcher_type"), _COMMUNICATION),
    **dict.fromkeys(("packing", "mix_strategy", "num_samples_each_epoch"), _ONLINE_ONLY),
    **dict.fromkeys(("save_checkpoint_format", "load_checkpoint_format", "save_safetensors"),
                    "checkpoint file format: checkpoints here are unified safetensors folders (flex checkpoints "
                    "are neither written nor resumed; an output_dir holding one is refused rather than overwritten)"),
    **dict.fromkeys(("eval_accumulation_steps",), "evaluation bookkeeping"),
}

RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")
ATTENTION_IMPLEMENTATIONS = {"flashmask": True, "sdpa": True, "eager": False}  # -> use_flash_attention
ONLINE_DATA = ("train_dataset_type", "train_dataset_path", "train_dataset_prob", "eval_dataset_type",
               "eval_dataset_path", "eval_dataset_prob")
PREPARE_DATA = ("preprocess the jsonl files with tools/preprocess_data.py and set dataset_type: pretrain with "
                "input_dir: \"1.0 <prefix>\"")


def _degrees(values: dict) -> tuple[dict[str, int], list[str]]:
    flags, refused = {}, []
    for ours, spellings in DEGREES.items():
        given = [name for name in spellings if name in values]
        if len(given) > 1:
            refused.append(f"{' and '.join(given)} (two spellings of one degree: keep {spellings[0]})")
        elif given and int(values[given[0]]) > 0:
            flags[ours] = int(values[given[0]])
    for name, why in UNBUILT_DEGREES.items():
        if int(values.get(name, -1)) > 1:
            refused.append(f"{name}={values[name]} ({why})")
    return flags, refused


def _recompute(values: dict) -> tuple[dict[str, Any], list[str]]:
    granularity, method, layers = (values.get(name) for name in RECOMPUTE_FIELDS)
    if granularity is None:
        return {"recompute": False}, []
    if granularity == "full" and method == "uniform" and layers == 1:
        return {"recompute": True, "recompute_granularity": "full"}, []
    return {}, [f"recompute_granularity={granularity!r} with recompute_method={method!r} and recompute_num_layers="
                f"{layers!r} (only each decoder layer recomputed is modelled: full, uniform, 1)"]


def _training(values: dict) -> list[str]:
    refused = []
    if values["stage"] != "PT":
        refused.append(f"stage={values['stage']!r} (this trainer pretrains: stage PT)")
    if str(values.get("fine_tuning", "LoRA")).lower() != "full":
        refused.append(f"fine_tuning={values.get('fine_tuning', 'LoRA')!r} (PaddleFormers' default is LoRA; only "
                       "full-parameter training is modelled: set fine_tuning: full)")
    if (values.get("bf16") or values.get("fp16")) and "fp16_opt_level" not in values:  # a given one: REFUSED's rule
        refused.append("fp16_opt_level left to PaddleFormers' default O1 (only AMP O2 is modelled: set "
                       "fp16_opt_level: O2)")
    return refused


def _schedule(values: dict) -> list[str]:
    decay = values.get("lr_scheduler_type", PADDLEFORMERS_DEFAULTS["lr_scheduler_type"])
    if decay == "linear" and values.get("min_lr"):
        return [f"min_lr={values['min_lr']!r} with lr_scheduler_type linear (PaddleFormers' linear schedule decays "
                "to 0 and never reads min_lr: remove it, or use cosine, which decays to it)"]
    return []


def _data(values: dict) -> list[str]:
    online = [name for name in ONLINE_DATA if name in values]
    if online:
        return [f"{', '.join(online)} (PaddleFormers' online datasets are not read here; {PREPARE_DATA})"]
    if values.get("dataset_type", "iterable") != "pretrain":
        return [f"dataset_type={values.get('dataset_type', 'iterable')!r} (only offline pretraining data is read: "
                f"{PREPARE_DATA})"]
    if values.get("do_eval") and int(values.get("eval_iters", -1)) <= 0:
        return ["do_eval without eval_iters (PaddleFormers sizes its validation set by eval_iters; set it)"]
    return []


def _attention(values: dict) -> tuple[dict[str, Any], list[str]]:
    flags, refused = {}, []
    implementation = values.get("_attn_implementation", "flashmask")
    if implementation in ATTENTION_IMPLEMENTATIONS:
        flags["use_flash_attention"] = ATTENTION_IMPLEMENTATIONS[implementation]
    else:
        refused.append(f"_attn_implementation={implementation!r} (one of {', '.join(ATTENTION_IMPLEMENTATIONS)})")
    if values.get("use_global_causal_attn"):  # its collator restarts positions at every document either way
        flags |= {"use_global_causal_attn": True, "reset_position_ids": True}
    return flags, refused


def _pipeline(values: dict) -> tuple[dict[str, Any], list[str]]:
    """PaddleFormers' flat schedule switches: `use_dualpipev` is --pipeline_schedule DualPipeV;
    `best_unbalanced_scheduler` (fleet's VPPFhenBInBalancedMemory) is not wired."""
    flags = {"pipeline_schedule": "DualPipeV"} if values.get("use_dualpipev") else {}
    refused = (["best_unbalanced_scheduler=true (fleet's VPPFhenBInBalancedMemory is not wired here; drop it: "
                "FThenB runs at pp micro-batches, VPP from 2 x pp)"] if values.get("best_unbalanced_scheduler") else [])
    return flags, refused


def is_paddleformers_recipe(values: dict) -> bool:
    """Whether a recipe's fields are PaddleFormers' (its trainer requires a `stage`; PaddleNLP's has none)."""
    return "stage" in values


def prepare(values: dict) -> tuple[dict[str, Any], set[str], list[str]]:
    """The flags of the fields that need more than a rename, the fields read, and the refusals."""
    degrees, refused = _degrees(values)
    recompute, recompute_refused = _recompute(values)
    attention, attention_refused = _attention(values)
    pipeline, pipeline_refused = _pipeline(values)
    refused += (recompute_refused + attention_refused + pipeline_refused + _training(values) + _schedule(values)
                + _data(values))
    consumed = {name for spellings in DEGREES.values() for name in spellings} | set(UNBUILT_DEGREES)
    consumed |= {*RECOMPUTE_FIELDS, *ONLINE_DATA, "stage", "fine_tuning", "dataset_type", "_attn_implementation",
                 "use_global_causal_attn", "use_dualpipev", "best_unbalanced_scheduler"}
    return degrees | recompute | attention | pipeline, consumed & set(values), refused


PADDLEFORMERS = Dialect(
    "PaddleFormers", "PaddleFormers'", {**RENAMED, "max_seq_len": "max_seq_length", "min_lr": "min_learning_rate"},
    PADDLEFORMERS_DEFAULTS, PADDLEFORMERS_NO_EFFECT, REFUSED, prepare)
