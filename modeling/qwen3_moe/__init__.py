"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms) with
mixture-of-experts layers. transformers 5 writes `num_local_experts` where 4.x writes `num_experts`:
both are read, `num_experts` is written (both versions read it). PaddleNLP 3.0.0b4 has no Qwen3-MoE."""

from __future__ import annotations

from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.moe_config import QwenMoEFields
from modeling.qwen2 import QwenWindows


class Qwen3MoeConfig(QwenMoEFields, QwenWindows):
    model_type = "qwen3_moe"
    qk_norm = "head"

    def __init__(self, vocab_size: int = 151936, hidden_size: int = 2048, intermediate_size: int = 6144,
                 num_hidden_layers: int = 24, num_attention_heads: int = 32, num_key_value_heads: int | None = 4,
                 head_dim: int | None = None, max_position_embeddings: int = 32768, attention_bias: bool = False,
                 sliding_window: int | None = None, **kwargs):
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, sliding_window=sliding_window, **kwargs)


QWEN3_MOE = decoder_family(Qwen3MoeConfig, "Qwen3MoeForCausalLM", "qwen3_moe", paddlenlp=False,
                           aliases={"num_local_experts": "num_experts"},
                           accepted=MOE_ACCEPTED)
Qwen3MoeForCausalLM, Qwen3MoeForCausalLMPipe = QWEN3_MOE.causal_lm, QWEN3_MOE.pipe
