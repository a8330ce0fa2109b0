"""LLaMA configuration with PaddleNLP's field names, so configs move between the two unchanged."""

from __future__ import annotations

from modeling.base import CausalLMConfig, ModelConfigError


class LlamaConfig(CausalLMConfig):
    model_type = "llama"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        recompute: bool = False,
        virtual_pp_degree: int = 1,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        **kwargs,
    ):
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        super().__init__(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
            recompute=recompute, virtual_pp_degree=virtual_pp_degree, pad_token_id=pad_token_id,
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs,
        )

    def validate(self) -> None:
        super().validate()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                                   f"num_key_value_heads={self.num_key_value_heads} (GQA groups must be equal)")
