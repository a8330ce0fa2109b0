"""Seed-OSS (ByteDance Seed-OSS-36B): LLaMA's layers with biases on q, k and v but not on o
(`attention_bias`, `attention_out_bias` apart) and its own head size. Its residual dropout is
modelled at zero only (`residual_dropout`, as `attention_dropout`: refused by name otherwise)."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family


class SeedOssConfig(DecoderConfig):
    model_type = "seed_oss"

    def __init__(self, vocab_size: int = 155136, hidden_size: int = 4096, intermediate_size: int = 27648,
                 num_hidden_layers: int = 64, num_attention_heads: int = 80, num_key_value_heads: int | None = 8,
                 head_dim: int | None = 128, max_position_embeddings: int = 524288, attention_bias: bool = True,
                 attention_out_bias: bool = False, mlp_bias: bool = False, pad_token_id: int | None = 1,
                 bos_token_id: int | None = 0, eos_token_id: int | None = 2, **kwargs):
        self.attention_bias, self.attention_out_bias, self.mlp_bias = attention_bias, attention_out_bias, mlp_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    @property
    def o_bias(self) -> bool:
        return bool(self.attention_out_bias)


SEED_OSS = decoder_family(SeedOssConfig, "SeedOssForCausalLM", "seed_oss", paddlenlp=False,
                          fixed={"residual_dropout": 0.0})
SeedOssForCausalLM, SeedOssForCausalLMPipe = SEED_OSS.causal_lm, SEED_OSS.pipe
