"""Phi-3 and Phi-4 (`phi3`: Phi-3-mini/medium, Phi-4, Phi-4-mini): LLaMA's layers with rotary on the
first `partial_rotary_factor` of each head (Phi-4-mini: 0.75), `longrope` scaling (short and long
factors chosen by the sequence length against `original_max_position_embeddings`, which Phi configs
keep top-level, and its attention factor), a sliding window on every layer when `sliding_window` is
set, and q, k and v stored fused in one `qkv_proj` (q's rows, then k's, then v's) and gate and up in
one `gate_up_proj` (gate's rows first). Ours are separate tensors: each tp rank reads its heads' rows
of q, of k and of v out of the fused tensor, and the export writes them fused again."""

from __future__ import annotations

from dataclasses import replace

from modeling.config import FULL, SLIDING, DecoderConfig
from modeling.decoder_family import decoder_family
from modeling.transformers_adapter import Stored

_ATTENTION, _MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


class Phi3Config(DecoderConfig):
    model_type = "phi3"

    def __init__(self, vocab_size: int = 32064, hidden_size: int = 3072, intermediate_size: int = 8192,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 max_position_embeddings: int = 4096, original_max_position_embeddings: int = 4096,
                 rms_norm_eps: float = 1e-5, partial_rotary_factor: float = 1.0, sliding_window: int | None = None,
                 bos_token_id: int | None = 1, eos_token_id: int | None = 32000, pad_token_id: int | None = 32000,
                 **kwargs):
        self.original_max_position_embeddings = original_max_position_embeddings
        self.partial_rotary_factor, self.sliding_window = partial_rotary_factor, sliding_window
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, **kwargs)

    def attention_types(self) -> list[str]:
        """transformers' Phi-3: every layer slides when `sliding_window` is set."""
        return [SLIDING if self.sliding_window else FULL] * self.num_hidden_layers

    def rope(self, index: int) -> tuple[float, dict | None]:
        """longrope's original length is the config's top-level one (transformers 4.x reads it there)."""
        scaling = self.rope_scaling
        if scaling and "original_max_position_embeddings" not in scaling:
            scaling = {**scaling, "original_max_position_embeddings": self.original_max_position_embeddings}
        return self.rope_theta, scaling


def fused_projections(stored: Stored, config: Phi3Config) -> Stored:
    """Where Phi-3 stores our separate q/k/v and gate/up weights: rows of its fused tensors."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, projection = module.rpartition(".")
    if projection in _ATTENTION:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return replace(stored, name=f"{prefix}.qkv_proj.{param}", axis=0, part=_ATTENTION.index(projection), parts=3,
                       sizes=(q, kv, kv))
    if projection in _MLP:
        return replace(stored, name=f"{prefix}.gate_up_proj.{param}", axis=0, part=_MLP.index(projection), parts=2)
    return stored


PHI3 = decoder_family(Phi3Config, "Phi3ForCausalLM", "phi3", paddlenlp=False, fuse=fused_projections,
                      fixed={"resid_pdrop": 0.0, "embd_pdrop": 0.0})
Phi3ForCausalLM, Phi3ForCausalLMPipe = PHI3.causal_lm, PHI3.pipe
