"""Gemma 2 and Gemma 3 (text): Gemma's `1 + weight` norms, scaled embeddings and GeGLU, with four norms
per layer (the attention's and the MLP's outputs normalised too: Gemma's `post_attention_layernorm`
normalises the attention output, its pre-MLP norm is `pre_feedforward_layernorm`), the softmax scale
`query_pre_attn_scalar`^-1/2, sliding windows on the layers `layer_types` names, and soft-capped
attention scores and logits where the config sets them (Gemma 2: 50 and 30). Gemma 3 adds per-head
q/k norms (`1 + weight`, before rotary) and a rotary per layer type: `rope_theta` (with
`rope_scaling`) on full layers, `rope_local_base_freq` unscaled on sliding ones.

transformers 5 spells Gemma 3's rotary as `rope_parameters` per layer type and Gemma 2's activation
`hidden_activation`; both are read (config_fields.as_transformers4). `use_bidirectional_attention`
(EmbeddingGemma) is refused unless false. Gemma 3's multimodal folders (`gemma3`) train this text model
and carry the rest (`modeling/multimodal.py`).
"""

from __future__ import annotations

from modeling.blocks.decoder import SANDWICH_NORMS
from modeling.config import FULL, SLIDING, DecoderConfig
from modeling.config_fields import any_value, falsy
from modeling.decoder_family import decoder_family


class Gemma2Config(DecoderConfig):
    model_type = "gemma2"
    norm_offset = True
    scales_embeddings = True
    norms = SANDWICH_NORMS
    pattern = 2  # transformers' default layer types: every `pattern`-th layer full, the others sliding

    def __init__(self, vocab_size: int = 256000, hidden_size: int = 2304, intermediate_size: int = 9216,
                 num_hidden_layers: int = 26, num_attention_heads: int = 8, num_key_value_heads: int | None = 4,
                 head_dim: int | None = 256, hidden_act: str = "gelu_pytorch_tanh", max_position_embeddings: int = 8192,
                 tie_word_embeddings: bool = True, attention_bias: bool = False, query_pre_attn_scalar: float = 256,
                 sliding_window: int | None = 4096, layer_types: list[str] | None = None,
                 final_logit_softcapping: float | None = 30.0, attn_logit_softcapping: float | None = 50.0,
                 pad_token_id: int | None = 0, bos_token_id: int | None = 2, eos_token_id: int | None = 1, **kwargs):
        self.attention_bias, self.query_pre_attn_scalar = attention_bias, query_pre_attn_scalar
        self.sliding_window, self.layer_types = sliding_window, layer_types
        self.final_logit_softcapping, self.attn_logit_softcapping = final_logit_softcapping, attn_logit_softcapping
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, hidden_act=hidden_act,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def attention_types(self) -> list[str]:
        return list(self.layer_types or [SLIDING if (i + 1) % self.pattern else FULL
                                         for i in range(self.num_hidden_layers)])

    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    def attention_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    @property
    def final_logit_softcap(self) -> float | None:
        return self.final_logit_softcapping


class Gemma3TextConfig(Gemma2Config):
    model_type = "gemma3_text"
    qk_norm = "head"

    def __init__(self, vocab_size: int = 262208, max_position_embeddings: int = 131072, rope_theta: float = 1e6,
                 rope_local_base_freq: float = 1e4, sliding_window_pattern: int = 6,
                 final_logit_softcapping: float | None = None, attn_logit_softcapping: float | None = None, **kwargs):
        self.rope_local_base_freq, self.sliding_window_pattern = rope_local_base_freq, sliding_window_pattern
        super().__init__(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                         final_logit_softcapping=final_logit_softcapping,
                         attn_logit_softcapping=attn_logit_softcapping, **kwargs)

    @property
    def pattern(self) -> int:
        return self.sliding_window_pattern

    def rope(self, index: int) -> tuple[float, dict | None]:
        """Full layers: `rope_theta` and `rope_scaling`; sliding layers: `rope_local_base_freq`, unscaled."""
        if self.attention_types()[index] == SLIDING:
            return self.rope_local_base_freq, None
        return self.rope_theta, self.rope_scaling


def _same_window(value, values: dict) -> bool:
    """Gemma 2 hub configs repeat the window as `sliding_window_size`."""
    return value is None or value == values.get("sliding_window")


GEMMA_ACCEPTED = {"use_bidirectional_attention": falsy, "cache_implementation": any_value,
                  "sliding_window_size": _same_window}
GEMMA2 = decoder_family(Gemma2Config, "Gemma2ForCausalLM", "gemma2", paddlenlp=False, accepted=GEMMA_ACCEPTED,
                        renamed={"hidden_activation": "hidden_act"})
GEMMA3_TEXT = decoder_family(Gemma3TextConfig, "Gemma3ForCausalLM", "gemma3", paddlenlp=False,
                             accepted=GEMMA_ACCEPTED, renamed={"hidden_activation": "hidden_act"},
                             aliases={"_sliding_window_pattern": "sliding_window_pattern"})
Gemma2ForCausalLM, Gemma2ForCausalLMPipe = GEMMA2.causal_lm, GEMMA2.pipe
Gemma3ForCausalLM, Gemma3ForCausalLMPipe = GEMMA3_TEXT.causal_lm, GEMMA3_TEXT.pipe
