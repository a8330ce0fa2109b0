"""Granite (IBM Granite 3.x dense): LLaMA's layers with four multipliers: the embeddings times
`embedding_multiplier`, each residual branch times `residual_multiplier`, the softmax scale
`attention_multiplier` (in place of head_dim^-1/2), the logits divided by `logits_scaling`."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class GraniteConfig(DecoderConfig):
    model_type = "granite"

    def __init__(self, vocab_size: int = 32000, attention_bias: bool = False, mlp_bias: bool = False,
                 embedding_multiplier: float = 1.0, residual_multiplier: float = 1.0,
                 attention_multiplier: float = 1.0, logits_scaling: float = 1.0, pad_token_id: int | None = None,
                 **kwargs):
        self.attention_bias, self.mlp_bias = attention_bias, mlp_bias
        self.embedding_multiplier, self.residual_multiplier = embedding_multiplier, residual_multiplier
        self.attention_multiplier, self.logits_scaling = attention_multiplier, logits_scaling
        super().__init__(vocab_size=vocab_size, pad_token_id=pad_token_id, **kwargs)

    @property
    def embedding_scale(self) -> float:
        return self.embedding_multiplier

    @property
    def logits_divisor(self) -> float:
        return self.logits_scaling

    def attention_scale(self) -> float:
        return self.attention_multiplier


GRANITE = decoder_family(GraniteConfig, "GraniteForCausalLM", "granite", paddlenlp=False)
GraniteForCausalLM, GraniteForCausalLMPipe = GRANITE.causal_lm, GRANITE.pipe
