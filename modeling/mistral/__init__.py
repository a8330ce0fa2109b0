"""Mistral: LLaMA's architecture with GQA by default and a sliding window on every layer (Mistral 7B
v0.1: 4096 keys; null in later releases)."""

from __future__ import annotations

from modeling.config import FULL, SLIDING, DecoderConfig
from modeling.decoder_family import decoder_family


class MistralConfig(DecoderConfig):
    model_type = "mistral"

    def __init__(self, intermediate_size: int = 14336, num_key_value_heads: int | None = 8,
                 max_position_embeddings: int = 131072, sliding_window: int | None = 4096, **kwargs):
        self.sliding_window = sliding_window
        super().__init__(intermediate_size=intermediate_size, num_key_value_heads=num_key_value_heads,
                         max_position_embeddings=max_position_embeddings, **kwargs)

    def attention_types(self) -> list[str]:
        """transformers' Mistral: every layer slides when `sliding_window` is set."""
        return [SLIDING if self.sliding_window else FULL] * self.num_hidden_layers


MISTRAL = decoder_family(MistralConfig, "MistralForCausalLM", "mistral", paddlenlp=True)
MistralForCausalLM, MistralForCausalLMPipe = MISTRAL.causal_lm, MISTRAL.pipe
