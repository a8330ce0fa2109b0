"""Gemma (v1): norms scale by 1 + weight, embeddings times sqrt(hidden_size), GeGLU MLP with GeLU's
tanh form, head_dim 256, tied embeddings."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class GemmaConfig(DecoderConfig):
    model_type = "gemma"
    norm_offset = True
    scales_embeddings = True

    def __init__(self, vocab_size: int = 256000, hidden_size: int = 3072, intermediate_size: int = 24576,
                 num_hidden_layers: int = 28, num_attention_heads: int = 16,
                 num_key_value_heads: int | None = 16, head_dim: int | None = 256,
                 hidden_act: str = "gelu_pytorch_tanh", max_position_embeddings: int = 8192,
                 tie_word_embeddings: bool = True, attention_bias: bool = False, pad_token_id: int | None = 0,
                 bos_token_id: int | None = 2, eos_token_id: int | None = 1, **kwargs):
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, hidden_act=hidden_act, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)


def _same_activation(value, values: dict) -> bool:
    """transformers 4.x Gemma configs may carry `hidden_activation` beside `hidden_act`; which one
    applies changed between versions, so they must agree."""
    return value is None or value == values.get("hidden_act", "gelu_pytorch_tanh")


GEMMA = decoder_family(GemmaConfig, "GemmaForCausalLM", "gemma", paddlenlp=True,
                       accepted={"hidden_activation": _same_activation,
                                 "use_bidirectional_attention": lambda value, _: not value})
GemmaForCausalLM, GemmaForCausalLMPipe = GEMMA.causal_lm, GEMMA.pipe
