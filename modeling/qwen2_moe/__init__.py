"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q, k, v biases) with
mixture-of-experts layers and a shared expert gated by sigmoid(shared_expert_gate(x)); dense layers
where `mlp_only_layers` / `decoder_sparse_step` say (which PaddleNLP 3.0.0b4's Qwen2-MoE ignores)."""

from __future__ import annotations

from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.moe_config import QwenMoEFields
from modeling.qwen2 import QwenWindows


class Qwen2MoeConfig(QwenMoEFields, QwenWindows):
    model_type = "qwen2_moe"
    o_bias = False
    qkv_bias = True  # a config field here (a switch elsewhere)

    def __init__(self, vocab_size: int = 151936, hidden_size: int = 2048, intermediate_size: int = 5632,
                 num_hidden_layers: int = 24, num_attention_heads: int = 16, num_key_value_heads: int | None = 16,
                 max_position_embeddings: int = 32768, num_experts: int = 60, num_experts_per_tok: int = 4,
                 moe_intermediate_size: int = 1408, shared_expert_intermediate_size: int = 5632,
                 qkv_bias: bool = True, sliding_window: int | None = None, **kwargs):
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.qkv_bias = qkv_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         moe_intermediate_size=moe_intermediate_size, sliding_window=sliding_window, **kwargs)


QWEN2_MOE = decoder_family(Qwen2MoeConfig, "Qwen2MoeForCausalLM", "qwen2_moe", paddlenlp=False,
                           accepted=MOE_ACCEPTED)
Qwen2MoeForCausalLM, Qwen2MoeForCausalLMPipe = QWEN2_MOE.causal_lm, QWEN2_MOE.pipe
