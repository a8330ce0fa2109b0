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
- `stage: PT`, or `stage: SFT` on chat data (`train_dataset_path` / `train_dataset_prob`, `packing`,
  `truncation_strategy`, `template_backend: jinja`: the model's own chat template; its Python `custom`
  templates refused), with the loss per optimizer step; `fine_tuning: full`, or `LoRA` (its default:
  `lora_rank`, `lora_alpha`, `rslora`, `lora_plus_scale` as our flags of those names);
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
    **dict.fromkeys(("greedy_intokens", "binpacking", "buffer_size", "packing_interval", "dataset_output_dir",
                     "make_offline_data", "packed_idx_cache_dir", "share_folder"),
                    "where SFT samples are drawn and packed: paddle-pp's seeded order, first fit over windows of 512"),
    **dict.fromkeys(("save_checkpoint_format", "load_checkpoint_format", "save_safetensors"),
                    "checkpoint file format: checkpoints here are unified safetensors folders (flex checkpoints "
                    "are neither written nor resumed; an output_dir holding one is refused rather than overwritten)"),
    **dict.fromkeys(("eval_accumulation_steps",), "evaluation bookkeeping"),
}

STAGES = ("PT", "SFT")
CHAT_FORMS = ("erniekit", "messages")
# SFT data fields modelled at one value (PaddleFormers' default): another is refused
SFT_REFUSED = {
    "max_prompt_len": (None, "prompts are not cut apart from their sample; --truncation_strategy cuts whole samples"),
    "random_shuffle": (True, "samples are drawn in a seeded shuffled order"),
    "split_multi_turn": (False, "a conversation is one sample, every assistant turn trained in it"),
    "encode_one_turn": (True, "the conversation is rendered whole by its template, as transformers renders it"),
    "use_template": (True, "samples are rendered by the model's chat template"),
    "padding_free": (False, "rows are packed (packing) or padded"),
    "truncate_packing": (True, "a sample longer than a row follows truncation_strategy"),
    "mix_strategy": ("concat", "sources are mixed by train_dataset_prob"),
    "eval_with_do_generation": (False, "evaluation is the loss"),
    "new_special_tokens_path": (None, "the tokenizer is the model folder's"),
    "custom_register_path": (None, "no PaddleFormers template or dataset registry is read"),
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


def _training(values: dict) -> tuple[dict[str, Any], list[str]]:
    """The stage (PT, or SFT on chat data) and `fine_tuning` (full, or LoRA, PaddleFormers' default)."""
    flags, refused = {}, []
    if values["stage"] not in STAGES:
        refused.append(f"stage={values['stage']!r} (this trainer runs stage PT and SFT)")
    tuning = str(values.get("fine_tuning", "LoRA")).lower()
    if tuning == "lora":
        flags["lora"] = True
    elif tuning != "full":
        refused.append(f"fine_tuning={values['fine_tuning']!r} (full or LoRA)")
    if (values.get("bf16") or values.get("fp16")) and "fp16_opt_level" not in values:  # a given one: REFUSED's rule
        refused.append("fp16_opt_level left to PaddleFormers' default O1 (only AMP O2 is modelled: set "
                       "fp16_opt_level: O2)")
    return flags, refused


def _schedule(values: dict) -> list[str]:
    decay = values.get("lr_scheduler_type", PADDLEFORMERS_DEFAULTS["lr_scheduler_type"])
    if decay == "linear" and values.get("min_lr"):
        return [f"min_lr={values['min_lr']!r} with lr_scheduler_type linear (PaddleFormers' linear schedule decays "
                "to 0 and never reads min_lr: remove it, or use cosine, which decays to it)"]
    return []


def _sft_data(values: dict) -> tuple[dict[str, Any], list[str]]:
    """SFT's chat data: the sources (our flags of the same names), their forms, the template (the model's own
    jinja template: PaddleFormers' Python `custom` templates are not modelled), packing, and the fields of its
    data pipeline that change what is trained, refused when given otherwise than modelled."""
    refused = []
    if not values.get("train_dataset_path"):
        refused.append("stage SFT without train_dataset_path (the chat data to fine-tune on)")
    for name in ("train_dataset_type", "eval_dataset_type"):
        if values.get(name, "erniekit") not in CHAT_FORMS:
            refused.append(f"{name}={values[name]!r} (chat data is one of {', '.join(CHAT_FORMS)})")
    if values.get("template_backend", "custom") != "jinja":
        refused.append(f"template_backend={values.get('template_backend', 'custom')!r} (PaddleFormers' default: its "
                       "Python templates, not modelled; set template_backend: jinja, the model folder's own chat "
                       "template, rendered as transformers renders it)")
    probs = [float(p) for p in str(values.get("eval_dataset_prob", "1.0")).split(",") if p.strip()]
    if len(set(probs)) > 1:
        refused.append(f"eval_dataset_prob={values['eval_dataset_prob']!r} (evaluation sources are mixed equally)")
    refused += [f"{name}={values[name]!r} ({why})" for name, (modelled, why) in SFT_REFUSED.items()
                if name in values and values[name] != modelled]
    flags = {"packing": bool(values.get("packing", False)), "calculate_per_token_loss": True}
    return flags, refused


def _data(values: dict) -> tuple[dict[str, Any], list[str]]:
    """The data of the stage: SFT's chat data (`_sft_data`), or PT's offline pretraining data."""
    if values["stage"] == "SFT":
        return _sft_data(values)
    online = [name for name in ONLINE_DATA if name in values]
    if online:
        return {}, [f"{', '.join(online)} (PaddleFormers' online datasets are not read here; {PREPARE_DATA})"]
    if values.get("dataset_type", "iterable") != "pretrain":
        return {}, [f"dataset_type={values.get('dataset_type', 'iterable')!r} (only offline pretraining data is "
                    f"read: {PREPARE_DATA})"]
    if values.get("do_eval") and int(values.get("eval_iters", -1)) <= 0:
        return {}, ["do_eval without eval_iters (PaddleFormers sizes its validation set by eval_iters; set it)"]
    return {}, []


def _attention(values: dict) -> tuple[dict[str, Any], list[str]]:
    flags, refused = {}, []
    implementation = values.get("_attn_implementation", values.get("attn_impl", "flashmask"))  # the newer name
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
    training, training_refused = _training(values)
    data, data_refused = _data(values)
    refused += (recompute_refused + attention_refused + pipeline_refused + training_refused + data_refused
                + _schedule(values))
    consumed = {name for spellings in DEGREES.values() for name in spellings} | set(UNBUILT_DEGREES)
    consumed |= {*RECOMPUTE_FIELDS, "stage", "fine_tuning", "dataset_type", "_attn_implementation", "attn_impl",
                 "use_global_causal_attn", "use_dualpipev", "best_unbalanced_scheduler"}
    if values["stage"] == "SFT":  # read as our flags of the same names, or above
        consumed |= {"train_dataset_type", "eval_dataset_type", "eval_dataset_prob", "template_backend", "template",
                     "packing", *SFT_REFUSED}
    else:
        consumed |= set(ONLINE_DATA)
    return degrees | recompute | attention | pipeline | training | data, consumed & set(values), refused


PADDLEFORMERS = Dialect(
    "PaddleFormers", "PaddleFormers'", {**RENAMED, "max_seq_len": "max_seq_length", "min_lr": "min_learning_rate"},
    PADDLEFORMERS_DEFAULTS, PADDLEFORMERS_NO_EFFECT, REFUSED, prepare)
