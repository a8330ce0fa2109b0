"""Mistral: LLaMA's architecture with GQA by default; its sliding window is modelled only where it
covers the whole training sequence (null, or not shorter than --max_seq_length)."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class MistralConfig(DecoderConfig):
    model_type = "mistral"

    def __init__(self, intermediate_size: int = 14336, num_key_value_heads: int | None = 8,
                 max_position_embeddings: int = 131072, sliding_window: int | None = 4096, **kwargs):
        self.sliding_window = sliding_window
        super().__init__(intermediate_size=intermediate_size, num_key_value_heads=num_key_value_heads,
                         max_position_embeddings=max_position_embeddings, **kwargs)

    def sliding_windows(self) -> dict[str, int]:
        return {"sliding_window": self.sliding_window} if self.sliding_window else {}


MISTRAL = decoder_family(MistralConfig, "MistralForCausalLM", "mistral", paddlenlp=True)
MistralForCausalLM, MistralForCausalLMPipe = MISTRAL.causal_lm, MISTRAL.pipe
