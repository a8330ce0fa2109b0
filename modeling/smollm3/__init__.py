"""SmolLM3: LLaMA's layers, with rotary only where `no_rope_layers[i]` is 1 (the others attend without
positions: NoPE, every `no_rope_layer_interval`-th layer by default) and sliding windows on the layers
`layer_types` names under `use_sliding_window`; tied embeddings by default."""

from __future__ import annotations

from modeling.config import FULL, SLIDING, DecoderConfig, ModelConfigError
from modeling.decoder_family import decoder_family


class SmolLM3Config(DecoderConfig):
    model_type = "smollm3"

    def __init__(self, vocab_size: int = 128256, hidden_size: int = 2048, intermediate_size: int = 11008,
                 num_hidden_layers: int = 36, num_attention_heads: int = 16, num_key_value_heads: int | None = 4,
                 max_position_embeddings: int = 32768, rope_theta: float = 2e6, tie_word_embeddings: bool = True,
                 attention_bias: bool = False, mlp_bias: bool = False, use_sliding_window: bool = False,
                 sliding_window: int | None = None, no_rope_layers: list[int] | None = None,
                 no_rope_layer_interval: int = 4, layer_types: list[str] | None = None,
                 pad_token_id: int | None = 128004, bos_token_id: int | None = 128000,
                 eos_token_id: int | None = 128001, **kwargs):
        self.attention_bias, self.mlp_bias = attention_bias, mlp_bias
        self.use_sliding_window, self.sliding_window = use_sliding_window, sliding_window
        self.no_rope_layer_interval = no_rope_layer_interval
        self.no_rope_layers = list(no_rope_layers) if no_rope_layers is not None else \
            [int((i + 1) % no_rope_layer_interval != 0) for i in range(num_hidden_layers)]
        self.layer_types = layer_types
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def attention_types(self) -> list[str]:
        """transformers' default: sliding on the NoPE layers under `use_sliding_window`."""
        sliding = self.use_sliding_window and self.sliding_window is not None
        return list(self.layer_types or [SLIDING if sliding and not rope else FULL for rope in self.no_rope_layers])

    def window(self, index: int) -> int | None:
        return super().window(index) if self.use_sliding_window else None

    def rope(self, index: int) -> tuple[float, dict | None] | None:
        return super().rope(index) if self.no_rope_layers[index] else None

    def validate(self) -> None:
        super().validate()
        if len(self.no_rope_layers) != self.num_hidden_layers or set(self.no_rope_layers) - {0, 1}:
            raise ModelConfigError(f"no_rope_layers must hold {self.num_hidden_layers} entries of 0 or 1, "
                                   f"not {self.no_rope_layers}")


SMOLLM3 = decoder_family(SmolLM3Config, "SmolLM3ForCausalLM", "smollm3", paddlenlp=False)
SmolLM3ForCausalLM, SmolLM3ForCausalLMPipe = SMOLLM3.causal_lm, SMOLLM3.pipe
