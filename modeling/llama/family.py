"""LLaMA as one registry entry: its config, model classes, TP plan and transformers names."""

from __future__ import annotations

from modeling.family import ModelFamily, TransformersNames
from modeling.llama.activations import layer_activation_bytes
from modeling.llama import tp_plan
from modeling.llama.config import LlamaConfig
from modeling.llama.modeling import LlamaForCausalLM
from modeling.llama.modeling_pp import LlamaForCausalLMPipe


def _to_hf(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name.removeprefix("llama.")


def _from_hf(name: str) -> str:
    return name if name == "lm_head.weight" else "llama." + name.removeprefix("model.")


LLAMA = ModelFamily(
    model_type="llama",
    architecture="LlamaForCausalLM",
    config_class=LlamaConfig,
    causal_lm=LlamaForCausalLM,
    pipe=LlamaForCausalLMPipe,
    tensor_plan=tp_plan.tensor_plan,
    check_tensor_parallel=tp_plan.check_tensor_parallel,
    tied_groups=tp_plan.tied_groups,
    layer_activation_bytes=layer_activation_bytes,
    transformers=TransformersNames(
        to_hf=_to_hf, from_hf=_from_hf,
        config_keys=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                     "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id"),
        fixed_config={"hidden_act": "silu", "tie_word_embeddings": False}),
)
