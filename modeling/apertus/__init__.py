"""Apertus (swiss-ai Apertus 8B, 70B): LLaMA's attention with per-head q/k RMSNorms before the rotary
(llama3-scaled at theta 1.2e7 when a config gives none), norms named `attention_layernorm` and
`feedforward_layernorm`, and an ungated MLP whose activation is xIELU, with two weights of its own per
layer (`blocks/mlp.py`: `LearnedActivation`, its beta and eps kept as the buffers transformers saves)."""

from __future__ import annotations

from modeling.blocks.decoder import NormPlacement
from modeling.blocks.mlp import XIELU, PlainMLP
from modeling.blocks.parts import Part
from modeling.config import DecoderConfig, ModelConfigError
from modeling.decoder_family import decoder_family

# transformers 5's ApertusConfig defaults (Apertus-8B's shape) where LLaMA's differ
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, max_position_embeddings=65536, pad_token_id=3, bos_token_id=1, eos_token_id=2,
                rope_theta=12000000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                     "original_max_position_embeddings": 8192,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0})


class ApertusConfig(DecoderConfig):
    model_type = "apertus"
    qk_norm = "head"
    norms = NormPlacement("attention_layernorm", None, "feedforward_layernorm", None)
    learned_activations = (XIELU,)

    def __init__(self, hidden_act: str = XIELU, attention_bias: bool = False, **kwargs):
        self.attention_bias = attention_bias
        super().__init__(hidden_act=hidden_act, **{**DEFAULTS, **kwargs})

    def feed_forward(self, index: int) -> tuple[str, Part]:
        return "mlp", PlainMLP(self.hidden_size, self.intermediate_size, self.hidden_act, bias=False)

    def validate(self) -> None:
        if self.hidden_act != XIELU:
            raise ModelConfigError(f"hidden_act={self.hidden_act!r} for Apertus: its MLP is modelled with xIELU, the "
                                   "activation of every released Apertus")
        super().validate()


APERTUS = decoder_family(ApertusConfig, "ApertusForCausalLM", "apertus", paddlenlp=False)
ApertusForCausalLM, ApertusForCausalLMPipe = APERTUS.causal_lm, APERTUS.pipe
