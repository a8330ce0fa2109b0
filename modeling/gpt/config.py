"""GPT configuration with PaddleNLP's GPTConfig field names, so configs move between the two unchanged."""

from __future__ import annotations

from modeling.base import CausalLMConfig


class GPTConfig(CausalLMConfig):
    """GPT-2 style: learned positions, pre-LayerNorm blocks, tanh-GELU MLP, output head tied to the
    word embedding. Dropout is not modelled: LLM pretraining runs without it and parity needs none."""

    model_type = "gpt"

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_activation: str = "gelu",
        max_position_embeddings: int = 1024,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        recompute: bool = False,
        virtual_pp_degree: int = 1,
        pad_token_id: int = 0,
        bos_token_id: int = 0,
        eos_token_id: int = 7,
        **kwargs,
    ):
        if not tie_word_embeddings:
            raise NotImplementedError("GPT here always ties the output head to the word embedding; "
                                      "set tie_word_embeddings=true or use LLaMA for an untied head.")
        if hidden_activation != "gelu":
            raise NotImplementedError(f"hidden_activation={hidden_activation!r} is not supported; GPT uses 'gelu'.")
        self.hidden_activation = hidden_activation
        self.layer_norm_eps = layer_norm_eps
        super().__init__(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
            recompute=recompute, virtual_pp_degree=virtual_pp_degree, pad_token_id=pad_token_id,
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs,
        )
