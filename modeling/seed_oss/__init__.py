"""Seed-OSS (ByteDance Seed-OSS-36B): LLaMA's layers with biases on q, k and v but not on o
(`attention_bias`, `attention_out_bias` apart) and its own head size. Its residual dropout is
modelled at zero only (`residual_dropout`, as `attention_dropout`: refused by name otherwise)."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family

# transformers 5's SeedOssConfig defaults (Seed-OSS-36B's shape) where LLaMA's differ
DEFAULTS = dict(vocab_size=155136, hidden_size=4096, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=80, num_key_value_heads=8, head_dim=128, max_position_embeddings=524288,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)


class SeedOssConfig(DecoderConfig):
    model_type = "seed_oss"

    def __init__(self, attention_bias: bool = True, attention_out_bias: bool = False, mlp_bias: bool = False,
                 **kwargs):
        self.attention_bias, self.attention_out_bias, self.mlp_bias = attention_bias, attention_out_bias, mlp_bias
        super().__init__(**{**DEFAULTS, **kwargs})

    @property
    def o_bias(self) -> bool:
        return bool(self.attention_out_bias)


SEED_OSS = decoder_family(SeedOssConfig, "SeedOssForCausalLM", "seed_oss", paddlenlp=False,
                          fixed={"residual_dropout": 0.0})
SeedOssForCausalLM, SeedOssForCausalLMPipe = SEED_OSS.causal_lm, SEED_OSS.pipe
