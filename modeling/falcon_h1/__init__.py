"""Falcon-H1 (`falcon_h1`: 0.5B to 34B): every layer runs attention and Mamba-2 side by side on the same
normed input (`blocks/parallel_mixers.py`), then a gated MLP after `pre_ff_layernorm`, with its muP
multipliers: the embeddings (`embedding_multiplier`) and logits (`lm_head_multiplier`); the attention's
input (`attention_in_multiplier`), keys (`key_multiplier`, folded into the softmax scale: the product
is the same) and output (`attention_out_multiplier`); Mamba-2's input (`ssm_in_multiplier`), its five
projections (`ssm_multipliers`: z, x, B, C, dt) and output (`ssm_out_multiplier`); the MLP's gate and
down projections (`mlp_multipliers`). Mamba-2 as Falcon-H1 builds it: `mamba_d_ssm` wide (or
`mamba_expand` x hidden), heads of `mamba_d_head` ("auto": that width over `mamba_n_heads`), its
gated norm only with `mamba_rms_norm` (the norm before the gate with `mamba_norm_before_gate`), the
projections' bias `mamba_proj_bias`, out_proj's `projectors_bias`, dt clamped to `time_step_limit`.

On disk the final norm is `final_layernorm`, the MLP `feed_forward`, Mamba-2's projections and convs
fused as Nemotron-H's (`mamba.in_proj`, `mamba.conv1d`)."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.decoder import Decoder, NormPlacement
from modeling.blocks.mamba2 import GATE_THEN_NORM, NORM_THEN_GATE, Mamba2, fused_mamba2
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.parallel_mixers import ParallelMixers
from modeling.config import DecoderConfig, ModelConfigError
from modeling.config_fields import any_value
from modeling.decoder_family import decoder_family
from modeling.transformers_adapter import Stored

MIXERS = "mixers"  # our name of a layer's pair (transformers keeps self_attn and mamba on the layer itself)
NORMS = NormPlacement("input_layernorm", None, "pre_ff_layernorm", None)
_READ_PAST = ("mamba_chunk_size", "num_logits_to_keep")


class FalconH1Config(DecoderConfig):
    model_type = "falcon_h1"

    def __init__(self, vocab_size: int = 128000, hidden_size: int = 4096, intermediate_size: int = 14336,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = 8,
                 max_position_embeddings: int = 8192, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0,
                 attention_bias: bool = False, mlp_bias: bool = False, projectors_bias: bool = False,
                 mamba_d_ssm: int | None = 1024, mamba_n_heads: int = 128, mamba_d_head: int | str = "auto",
                 mamba_n_groups: int = 1, mamba_d_state: int = 256, mamba_d_conv: int = 4, mamba_expand: int = 2,
                 mamba_conv_bias: bool = True, mamba_proj_bias: bool = False, mamba_norm_before_gate: bool = True,
                 mamba_rms_norm: bool = False, time_step_limit: list[float] | tuple[float, float] | None = (0.0, float("inf")),
                 lm_head_multiplier: float = 1.0, embedding_multiplier: float = 1.0,
                 mlp_multipliers: list[float] | None = None, key_multiplier: float = 1.0,
                 attention_out_multiplier: float = 1.0, attention_in_multiplier: float = 1.0,
                 ssm_multipliers: list[float] | None = None, ssm_in_multiplier: float = 1.0,
                 ssm_out_multiplier: float = 1.0, pad_token_id: int | None = 0, **kwargs):
        self.attention_bias, self.mlp_bias, self.projectors_bias = attention_bias, mlp_bias, projectors_bias
        self.mamba_d_ssm, self.mamba_n_heads, self.mamba_n_groups = mamba_d_ssm, mamba_n_heads, mamba_n_groups
        self.mamba_d_state, self.mamba_d_conv, self.mamba_expand = mamba_d_state, mamba_d_conv, mamba_expand
        width = mamba_expand * hidden_size if mamba_d_ssm is None else mamba_d_ssm
        self.mamba_d_head = width // mamba_n_heads if mamba_d_head == "auto" else mamba_d_head
        self.mamba_conv_bias, self.mamba_proj_bias = mamba_conv_bias, mamba_proj_bias
        self.mamba_norm_before_gate, self.mamba_rms_norm = mamba_norm_before_gate, mamba_rms_norm
        self.time_step_limit = None if time_step_limit is None else list(time_step_limit)
        self.lm_head_multiplier, self.embedding_multiplier = lm_head_multiplier, embedding_multiplier
        self.mlp_multipliers = list(mlp_multipliers or [1.0, 1.0])
        self.key_multiplier, self.attention_out_multiplier = key_multiplier, attention_out_multiplier
        self.attention_in_multiplier = attention_in_multiplier
        self.ssm_multipliers = list(ssm_multipliers or [1.0] * 5)
        self.ssm_in_multiplier, self.ssm_out_multiplier = ssm_in_multiplier, ssm_out_multiplier
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, pad_token_id=pad_token_id, **kwargs)

    @property
    def embedding_scale(self) -> float | None:
        return self.embedding_multiplier

    @property
    def logits_divisor(self) -> float | None:
        return None if self.lm_head_multiplier == 1.0 else 1.0 / self.lm_head_multiplier

    def attention_scale(self) -> float:
        return self.head_dim ** -0.5 * self.key_multiplier

    def mixer(self) -> Mamba2:
        norm = (NORM_THEN_GATE if self.mamba_norm_before_gate else GATE_THEN_NORM) if self.mamba_rms_norm else None
        limit = tuple(self.time_step_limit) if self.time_step_limit is not None else (0.0, float("inf"))
        return Mamba2(self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_n_groups, self.mamba_d_state,
                      self.mamba_d_conv, self.rms_norm_eps, limit, self.mamba_conv_bias, self.mamba_proj_bias,
                      self.projectors_bias, norm, self.ssm_in_multiplier, tuple(self.ssm_multipliers))

    def feed_forward(self, index: int) -> tuple[str, GatedMLP]:
        return "feed_forward", GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias,
                                        multipliers=tuple(self.mlp_multipliers))

    def decoder_layer(self, index: int) -> Decoder:
        pair = ParallelMixers(self.attention(index), self.mixer(), self.attention_in_multiplier,
                              self.attention_out_multiplier, self.ssm_out_multiplier)
        name, part = self.feed_forward(index)
        return Decoder(index, pair, part, self.hidden_norm(), feed_forward_name=name, attention_name=MIXERS,
                       norms=NORMS)

    def validate(self) -> None:
        if len(self.mlp_multipliers) != 2 or len(self.ssm_multipliers) != 5:
            raise ModelConfigError(f"mlp_multipliers={self.mlp_multipliers} and ssm_multipliers={self.ssm_multipliers} "
                                   "must hold 2 (gate, down) and 5 (z, x, B, C, dt) numbers")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ModelConfigError(f"mamba_n_heads={self.mamba_n_heads} is not divisible by "
                                   f"mamba_n_groups={self.mamba_n_groups}")
        super().validate()


def stored_names(stored: Stored, config: FalconH1Config) -> Stored:
    """Its folders' names: the pair's mixers on the layer itself, the final norm `final_layernorm`, and
    Mamba-2's fused projections and convs (`fused_mamba2`)."""
    name = stored.name.replace(f".{MIXERS}.", ".", 1)
    if name == "model.norm.weight":
        name = "model.final_layernorm.weight"
    return fused_mamba2(replace(stored, name=name), config.mixer(), "mamba")


FALCON_H1 = decoder_family(FalconH1Config, "FalconH1ForCausalLM", "falcon_h1", paddlenlp=False,
                           accepted=dict.fromkeys(_READ_PAST, any_value), fuse=stored_names)
FalconH1ForCausalLM, FalconH1ForCausalLMPipe = FALCON_H1.causal_lm, FALCON_H1.pipe
