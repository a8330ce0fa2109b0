"""OLMo 3: OLMo-2's layers (norms after the attention and the MLP, RMSNorms over the whole q and k
projections) with sliding windows on three layers of four (`layer_types`, `sliding_window`) and a
rotary per layer type: transformers 5's `rope_parameters` give the sliding layers their theta
(read as `rope_local_base_freq`) and the full layers theirs with its scaling (Olmo 3's long-context
YaRN applies to full layers only)."""

from __future__ import annotations

from modeling.config import FULL, SLIDING
from modeling.decoder_family import decoder_family
from modeling.olmo2 import Olmo2Config


class Olmo3Config(Olmo2Config):
    model_type = "olmo3"

    def __init__(self, rope_theta: float = 500000.0, rope_local_base_freq: float | None = None,
                 sliding_window: int | None = 4096, layer_types: list[str] | None = None, **kwargs):
        self.sliding_window, self.layer_types = sliding_window, layer_types
        self.rope_local_base_freq = rope_local_base_freq
        super().__init__(rope_theta=rope_theta, **kwargs)

    def attention_types(self) -> list[str]:
        """transformers' default: every fourth layer full, the others sliding."""
        return list(self.layer_types or [SLIDING if (i + 1) % 4 else FULL for i in range(self.num_hidden_layers)])

    def transformers_spelling(self, values: dict) -> dict:
        """transformers 5's `rope_parameters` per layer type: its Olmo3Config has no spelling for the sliding
        layers' own theta."""
        values = dict(values)
        full = {"rope_type": "default", **(values.pop("rope_scaling") or {}), "rope_theta": values.pop("rope_theta")}
        local = values.pop("rope_local_base_freq") or full["rope_theta"]
        return {**values, "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}}}

    def rope(self, index: int) -> tuple[float, dict | None]:
        """Full layers: `rope_theta` and `rope_scaling`; sliding layers: their own theta (the full layers'
        when the config gives none), unscaled."""
        if self.attention_types()[index] == SLIDING:
            return self.rope_local_base_freq or self.rope_theta, None
        return self.rope_theta, self.rope_scaling


OLMO3 = decoder_family(Olmo3Config, "Olmo3ForCausalLM", "olmo3", paddlenlp=False)
Olmo3ForCausalLM, Olmo3ForCausalLMPipe = OLMO3.causal_lm, OLMO3.pipe
