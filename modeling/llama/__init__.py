"""LLaMA 1-3.x: untied or tied embeddings (Llama 3.2 1B/3B, SmolLM), rope scaling `linear` and
`llama3` (Llama 3.1+), optional attention and MLP biases."""

from __future__ import annotations

from modeling.config import DecoderConfig
from modeling.decoder_family import decoder_family
from modeling.paddlenlp_fused import FFN, QKV


class LlamaConfig(DecoderConfig):
    model_type = "llama"

    def __init__(self, attention_bias: bool = False, mlp_bias: bool = False, **kwargs):
        self.attention_bias = attention_bias  # q, k, v and o
        self.mlp_bias = mlp_bias
        super().__init__(**kwargs)


LLAMA = decoder_family(LlamaConfig, "LlamaForCausalLM", "llama", paddlenlp=True, paddlenlp_fused=(QKV, FFN))
LlamaForCausalLM, LlamaForCausalLMPipe = LLAMA.causal_lm, LLAMA.pipe
