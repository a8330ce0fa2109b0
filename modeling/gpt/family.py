"""GPT as one registry entry: its config, model classes and TP plan (no transformers mapping yet)."""

from __future__ import annotations

from modeling.family import ModelFamily
from modeling.gpt.activations import layer_activation_bytes
from modeling.gpt import tp_plan
from modeling.gpt.config import GPTConfig
from modeling.gpt.modeling import GPTForCausalLM
from modeling.gpt.modeling_pp import GPTForCausalLMPipe

GPT = ModelFamily(
    model_type="gpt",
    architecture="GPTForCausalLM",
    config_class=GPTConfig,
    causal_lm=GPTForCausalLM,
    pipe=GPTForCausalLMPipe,
    tensor_plan=tp_plan.tensor_plan,
    check_tensor_parallel=tp_plan.check_tensor_parallel,
    tied_groups=tp_plan.tied_groups,
    layer_activation_bytes=layer_activation_bytes,
)
