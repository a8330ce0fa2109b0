"""ERNIE 4.5 (dense, ERNIE-4.5-0.3B): LLaMA's layers with rotary on interleaved pairs (ERNIE's
`rotate_half` pairs channels 2i and 2i + 1), `use_bias` on every projection of the attention and
the MLP, `head_dim` given, tied embeddings by default."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class Ernie4_5Config(DecoderConfig):
    model_type = "ernie4_5"
    interleaved_rotary = True

    def __init__(self, vocab_size: int = 103424, hidden_size: int = 1024, intermediate_size: int = 3072,
                 num_hidden_layers: int = 18, num_attention_heads: int = 16, num_key_value_heads: int | None = 2,
                 head_dim: int | None = 128, max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 500000.0, use_bias: bool = False, tie_word_embeddings: bool = True, **kwargs):
        self.use_bias = use_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def qkv_bias(self) -> bool:
        return self.use_bias

    @property
    def o_bias(self) -> bool:
        return self.use_bias

    @property
    def mlp_bias(self) -> bool:
        return self.use_bias


ERNIE4_5 = decoder_family(Ernie4_5Config, "Ernie4_5ForCausalLM", "ernie4_5", paddlenlp=False)
Ernie4_5ForCausalLM, Ernie4_5ForCausalLMPipe = ERNIE4_5.causal_lm, ERNIE4_5.pipe
