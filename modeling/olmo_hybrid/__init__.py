"""Olmo-Hybrid (`olmo_hybrid`: Olmo-Hybrid 7B): Gated DeltaNet layers (`linear_attention` in
`layer_types`, norms before the mixer and the MLP, as LLaMA's) beside OLMo-2's attention layers (norms
after the attention and the MLP; RMSNorms over the whole q and k projections; no windows). Its Gated
DeltaNet is Qwen3.5's with separate q/k/v/a/b projections, a `g_proj` output gate, `o_proj`, an
`o_norm` of eps 1e-5 whatever `rms_norm_eps` says (fla's fused gated norm), and the write strength
doubled (`linear_allow_neg_eigval`, the default: `GatedDelta.beta_scale`).

Its folders name the norm before a linear layer's mixer `attention_layer_norm` and every layer's
norm after the mixer's or attention's branch starts `feedforward_layer_norm` (transformers renames them
as it loads and back as it saves), and store the three convs apart (`q_conv1d`...), which
transformers concatenates as it loads and saves back in equal thirds (read through `interop.recut`).
Its attention layers rotate unless `rope_parameters` sets `rope_theta` null (NoPE, as transformers 5.23
reads it; a null `rope_parameters` is transformers' default rotary, theta 1e4). The `linear_*` sizes left null take transformers' defaults
(key heads as attention heads, d_k = 0.75 hidden / heads, d_v = 2 d_k); the decay and time-step init
ranges are read and dropped (they shape a fresh model's draw only)."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.attention import Attention
from modeling.blocks.decoder import PRE_NORMS, NormPlacement
from modeling.blocks.gated_delta import GatedDelta, stored_apart
from modeling.config import FULL
from modeling.config_fields import any_value
from modeling.decoder_family import decoder_family
from modeling.olmo2 import Olmo2Config
from modeling.qwen3_5 import LINEAR, MTP_UNREAD, check_linear_layers
from modeling.transformers_adapter import Stored

GATED_NORM_EPS = 1e-5  # transformers' OlmoHybridRMSNormGated is built with it, whatever rms_norm_eps says
NEGATIVE_EIGENVALUES = 2.0  # beta's scale with linear_allow_neg_eigval: the transition's eigenvalues reach -1
_LAYER_NORMS = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}
_CONVS = tuple(f"linear_attn.{name}.weight" for name in ("q_conv1d", "k_conv1d", "v_conv1d"))
_INIT_RANGES = ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor")


class OlmoHybridConfig(Olmo2Config):
    model_type = "olmo_hybrid"

    def __init__(self, vocab_size: int = 100352, hidden_size: int = 3840, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 30, max_position_embeddings: int = 65536,
                 rms_norm_eps: float = 1e-6, rope_theta: float | None = 10000.0, layer_types: list[str] | None = None,
                 linear_num_key_heads: int | None = None, linear_num_value_heads: int | None = None,
                 linear_key_head_dim: int | None = None, linear_value_head_dim: int | None = None,
                 linear_conv_kernel_dim: int = 4, linear_allow_neg_eigval: bool = True,
                 pad_token_id: int | None = 100277, eos_token_id: int | None = 100257, **kwargs):
        self.layer_types = list(layer_types or [FULL if i % 4 == 3 else LINEAR for i in range(num_hidden_layers)])
        if layer_types is None and FULL not in self.layer_types:
            self.layer_types[-1] = FULL
        self.linear_num_key_heads = linear_num_key_heads or num_attention_heads
        self.linear_num_value_heads = linear_num_value_heads or num_attention_heads
        self.linear_key_head_dim = linear_key_head_dim or int(0.75 * hidden_size / self.linear_num_key_heads)
        self.linear_value_head_dim = linear_value_head_dim or 2 * self.linear_key_head_dim
        self.linear_conv_kernel_dim, self.linear_allow_neg_eigval = linear_conv_kernel_dim, linear_allow_neg_eigval
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         rope_theta=rope_theta, pad_token_id=pad_token_id, eos_token_id=eos_token_id, **kwargs)

    def rope(self, index: int) -> tuple[float, dict | None] | None:
        """No rotary where the config's theta is null."""
        return None if self.rope_theta is None else super().rope(index)

    def token_mixer(self, index: int) -> tuple[str, GatedDelta | Attention]:
        if self.layer_types[index] != LINEAR:
            return super().token_mixer(index)
        return "linear_attn", GatedDelta(
            self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
            self.linear_value_head_dim, self.linear_conv_kernel_dim, GATED_NORM_EPS,
            NEGATIVE_EIGENVALUES if self.linear_allow_neg_eigval else 1.0)

    def layer_norms(self, index: int) -> NormPlacement:
        """LLaMA's pre-norms around a linear layer's mixer, OLMo-2's post-norms around attention."""
        return PRE_NORMS if self.layer_types[index] == LINEAR else super().layer_norms(index)

    def validate(self) -> None:
        check_linear_layers(self)
        super().validate()


def stored_names(stored: Stored, config: OlmoHybridConfig) -> Stored:
    """Its folders' names of our layer norms (`_LAYER_NORMS`) and of the mixer's parts (`stored_apart`)."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if part in _LAYER_NORMS and ".layers." in prefix:
        return replace(stored, name=f"{prefix}.{_LAYER_NORMS[part]}.{param}")
    return stored_apart(stored, "linear_attn")


OLMO_HYBRID = decoder_family(OlmoHybridConfig, "OlmoHybridForCausalLM", "olmo_hybrid", paddlenlp=False,
                             fuse=stored_names, accepted=dict.fromkeys(_INIT_RANGES, any_value), recut=(_CONVS,),
                             unread=MTP_UNREAD)
OlmoHybridForCausalLM, OlmoHybridForCausalLMPipe = OLMO_HYBRID.causal_lm, OLMO_HYBRID.pipe
