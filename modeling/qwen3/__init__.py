"""Qwen3 (dense): per-head RMSNorm on q and k before rotary, `head_dim` given (not hidden / heads),
optional attention biases. PaddleNLP 3.0.0b4 has no Qwen3; our names follow its Qwen2's."""

from __future__ import annotations

from modeling.decoder_family import decoder_family
from modeling.qwen2 import QwenWindows


class Qwen3Config(QwenWindows):
    model_type = "qwen3"
    qk_norm = "head"

    def __init__(self, vocab_size: int = 151936, intermediate_size: int = 22016, num_key_value_heads: int | None = 32, head_dim: int | None = 128,
                 max_position_embeddings: int = 32768, attention_bias: bool = False, **kwargs):
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, intermediate_size=intermediate_size,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, **kwargs)


QWEN3 = decoder_family(Qwen3Config, "Qwen3ForCausalLM", "qwen3", paddlenlp=False)
Qwen3ForCausalLM, Qwen3ForCausalLMPipe = QWEN3.causal_lm, QWEN3.pipe
