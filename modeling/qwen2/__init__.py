"""Qwen2 / Qwen2.5: biases on q, k and v (not o), tied embeddings in the small sizes; sliding
windows on the layers `use_sliding_window` and `max_window_layers` (or `layer_types`) say."""

from __future__ import annotations

from modeling.config import FULL, SLIDING, DecoderConfig
from modeling.decoder_family import decoder_family
from modeling.paddlenlp_fused import FFN, QKV


class QwenWindows(DecoderConfig):
    """Qwen's per-layer attention types: sliding from `max_window_layers` on when `use_sliding_window`."""

    def __init__(self, use_sliding_window: bool = False, sliding_window: int | None = 4096,
                 max_window_layers: int = 28, layer_types: list[str] | None = None, **kwargs):
        self.use_sliding_window, self.sliding_window = use_sliding_window, sliding_window
        self.max_window_layers, self.layer_types = max_window_layers, layer_types
        super().__init__(**kwargs)

    def attention_types(self) -> list[str]:
        """transformers' rule: the types given, else sliding from `max_window_layers` on under
        `use_sliding_window` (with a window)."""
        sliding = self.use_sliding_window and self.sliding_window is not None
        return list(self.layer_types or [SLIDING if sliding and i >= self.max_window_layers else FULL
                                          for i in range(self.num_hidden_layers)])

    def window(self, index: int) -> int | None:
        """transformers drops the window without `use_sliding_window`, whatever the layer types say."""
        return super().window(index) if self.use_sliding_window else None


class Qwen2Config(QwenWindows):
    model_type = "qwen2"
    o_bias = False

    def __init__(self, vocab_size: int = 151936, intermediate_size: int = 22016, num_key_value_heads: int | None = 32, max_position_embeddings: int = 32768,
                 **kwargs):
        super().__init__(vocab_size=vocab_size, intermediate_size=intermediate_size,
                         num_key_value_heads=num_key_value_heads,
                         max_position_embeddings=max_position_embeddings, **kwargs)

    @property
    def qkv_bias(self) -> bool:
        return True


QWEN2 = decoder_family(Qwen2Config, "Qwen2ForCausalLM", "qwen2", paddlenlp=True, paddlenlp_fused=(QKV, FFN))
Qwen2ForCausalLM, Qwen2ForCausalLMPipe = QWEN2.causal_lm, QWEN2.pipe
