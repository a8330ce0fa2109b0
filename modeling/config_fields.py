"""Which config.json fields leave the model's computation alone, and the one translation of other
spellings into transformers 4.x's (the form our configs keep).

`HARMLESS` is the documented list (docs/models.md): bookkeeping, inference and
generation settings, other tasks' heads, and PaddleNLP's (and PaddleFormers') run and kernel settings. A few of them are
harmless only at one value (an encoder-decoder flag): the predicate says which. PaddleNLP's fused-
projection flags say where a folder stores tensors (`paddle_pp.interop.pretrained` reads them). A
field on no list and not modelled by the family is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

Check = Callable[[Any, dict], bool]


def any_value(_value, _values) -> bool:
    return True


def falsy(value, _values) -> bool:
    return not value


def zero(value, _values) -> bool:
    return value in (0, 0.0, None)


_BOOKKEEPING = ("architectures", "model_type", "transformers_version", "paddlenlp_version", "paddleformers_version",
                "_name_or_path", "name_or_path", "torch_dtype", "dtype", "tokenizer_class", "initializer_factor")
_INFERENCE = ("use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
              "chunk_size_feed_forward", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
              "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
              "bad_words_ids", "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id",
              "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
              "typical_p", "diversity_penalty", "num_beam_groups", "output_scores", "return_dict_in_generate",
              "encoder_no_repeat_ngram_size", "_attn_implementation", "attn_implementation",
              "_attn_implementation_autoset", "tf_legacy_loss", "use_bfloat16")
_OTHER_TASKS = ("id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "task_specific_params",
                "prefix", "classifier_dropout", "sep_token_id", "decoder_start_token_id", "cross_attention_hidden_size",
                "is_decoder", "keys_to_ignore_at_inference")
_PADDLENLP_RUN = ("tensor_parallel_degree", "tensor_parallel_rank", "tensor_parallel_output", "sequence_parallel",
                  "pipeline_parallel_degree", "virtual_pp_degree", "recompute",
                  "fuse_sequence_parallel_allreduce", "sep_parallel_degree", "context_parallel_degree",
                  "use_flash_attention", "use_fused_rms_norm", "use_fused_rope", "use_fused_linear",
                  "use_fused_dropout_add", "use_fast_layer_norm", "use_recompute", "recompute_granularity",
                  "pp_recompute_interval", "no_recompute_layers", "recompute_use_reentrant", "dpo_config",
                  "immediate_clear_past_key_value", "use_flash_attention_for_generation",
                  "use_last_token_for_generation", "seq_length", "use_sparse_head_and_loss_fn",
                  "use_fused_head_and_loss_fn", "kto_config", "quantization_config_dict",
                  "fuse_rms_norm")  # the last: PaddleFormers' switch for its fused RMSNorm kernel (same arithmetic)
_ONLY_WHEN_OFF = ("is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "alibi",
                  "use_long_sequence_strategies", "long_sequence_strategy_type", "long_sequence_strategy_name",
                  "long_sequence_init_args")

def dequantized_on_read(value, _values) -> bool:
    """A `quantization_config` whose weights are dequantized exactly as they are read (then trained
    and saved unquantized, `paddle_pp/interop/quantized.py`): none, GPT-OSS's MXFP4, or block-scaled
    e4m3 FP8."""
    if not value or value.get("quant_method") == "mxfp4":
        return True
    block = value.get("weight_block_size")
    return value.get("quant_method") == "fp8" and value.get("fmt", "e4m3") == "e4m3" and \
        isinstance(block, list) and len(block) == 2


HARMLESS: dict[str, Check] = {
    **{name: any_value for name in _BOOKKEEPING + _INFERENCE + _OTHER_TASKS + _PADDLENLP_RUN},
    **{name: falsy for name in _ONLY_WHEN_OFF},
    "quantization_config": dequantized_on_read,
}


PER_LAYER_TYPE = ("full_attention", "sliding_attention")  # transformers 5's rope_parameters per layer type (Gemma 3)


def as_transformers4(raw: dict) -> dict:
    """`raw` in transformers 4.x spelling: transformers 5's `rope_parameters` ({rope_theta,
    rope_type, partial_rotary_factor, ...}) as `rope_theta`, `rope_scaling` (None for the default
    type) and `partial_rotary_factor`; Gemma 3's per layer type ({full_attention: ...,
    sliding_attention: ...}) as the full layers' `rope_theta` and `rope_scaling` and the sliding
    layers' `rope_local_base_freq` (a sliding-layer scaling has no 4.x spelling: it stays under its
    5.x name, which no family models, so it is refused by name); and PaddleNLP's `rope_scaling_type` /
    `rope_scaling_factor` as `rope_scaling`."""
    values = dict(raw)
    parameters = values.pop("rope_parameters", None)
    if parameters is not None and set(parameters) <= set(PER_LAYER_TYPE) and parameters:
        local = dict(parameters.get("sliding_attention", {}))
        if "rope_theta" in local:
            values["rope_local_base_freq"] = local.pop("rope_theta")
        if local not in ({}, {"rope_type": "default"}):
            values["rope_parameters.sliding_attention"] = local
        parameters = parameters.get("full_attention", {})
    if parameters is not None:
        parameters = dict(parameters)
        if "rope_theta" in parameters:
            values["rope_theta"] = parameters.pop("rope_theta")
        if "partial_rotary_factor" in parameters:
            values["partial_rotary_factor"] = parameters.pop("partial_rotary_factor")
        values["rope_scaling"] = None if parameters in ({}, {"rope_type": "default"}) else parameters
    kind, factor = values.pop("rope_scaling_type", None), values.pop("rope_scaling_factor", None)
    if kind is not None:
        values["rope_scaling"] = {"rope_type": kind, "factor": factor}
    return values

# Read and dropped in every mixture-of-experts family: transformers adds its pooled aux loss to the loss
# it returns when set; paddle-pp always trains with the per-layer aux loss (docs/moe.md)
MOE_ACCEPTED: dict[str, Check] = {"output_router_logits": any_value}
