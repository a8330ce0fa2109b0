"""Qwen3.5 (text, dense: `qwen3_5_text`; Qwen3.6 and 3.8 share it): layers whose token mixer is Gated
DeltaNet (`linear_attention` in `layer_types`, every layer but each `full_attention_interval`-th by
default) or gated attention (`full_attention`: q_proj emits each head's q and a sigmoid gate on its
output), `1 + weight` RMSNorms (zero-centred; the mixer's gated norm is a plain one), per-head q/k
norms, rotary on the first `partial_rotary_factor` (0.25) of each head. Its rotary is multimodal
(`mrope_section`: three position streams interleaved over the rotated channels); for text the three
streams are the same positions, so it is ordinary partial rotary (`mrope_*` are read past; the test
compares transformers' own logits).

Qwen3.5-MoE (`qwen3_5_moe_text`: 35B-A3B to 397B-A17B) is the same with a mixture of experts in every
layer: softmax top-k, always renormalised, and a shared expert gated by sigmoid(shared_expert_gate(x))
(Qwen2-MoE's block; its folders store experts one by one as Qwen2-MoE's do).

transformers fuses the linear layers' q, k and v projections (`in_proj_qkv`: q's rows, k's, v's)
and their conv (`conv1d`, channels likewise); ours are separate tensors, read out of the fused ones
(each tp rank its heads' rows of each) and written back fused.
"""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.attention import Attention
from modeling.blocks.gated_delta import GatedDelta
from modeling.config import FULL, DecoderConfig, ModelConfigError, check_layer_kinds
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig
from modeling.transformers_adapter import Stored

LINEAR = "linear_attention"  # transformers' layer type of a Gated DeltaNet layer
_FUSED_QKV = {"in_proj_q": ("in_proj_qkv", 0), "in_proj_k": ("in_proj_qkv", 1), "in_proj_v": ("in_proj_qkv", 2),
              "conv_q": ("conv1d", 0), "conv_k": ("conv1d", 1), "conv_v": ("conv1d", 2)}
_MULTIMODAL_ROTARY = ("mrope_section", "mrope_interleaved")
# The multi-token prediction layer released Qwen3.5 / Qwen3-Next folders carry (`mtp.*`, sized by these config
# fields): left unread with a note, as transformers leaves it (`_keys_to_ignore_on_load_unexpected`)
MTP_UNREAD = ("mtp.",)
MTP_FIELDS = dict.fromkeys(("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"), any_value)
# fields Qwen's released configs write that transformers 5 reads past: its full layers are always gated (a
# config turning the gate off is another model), the recurrent cache's dtype is inference's
RELEASED_FIELDS = {"attn_output_gate": lambda value, _: value is True, "mamba_ssm_dtype": any_value}


class Qwen3_5TextConfig(DecoderConfig):
    model_type = "qwen3_5_text"
    qk_norm = "head"
    norm_offset = True
    derived_fields = ("full_attention_interval",)  # transformers reads it only to make layer_types, which it writes

    def __init__(self, vocab_size: int = 248320, hidden_size: int = 4096, intermediate_size: int = 12288,
                 num_hidden_layers: int = 32, num_attention_heads: int = 16, num_key_value_heads: int | None = 4,
                 head_dim: int | None = 256, max_position_embeddings: int = 32768, rope_theta: float = 10000.0,
                 rope_scaling: dict | None = None, partial_rotary_factor: float = 0.25, attention_bias: bool = False,
                 linear_conv_kernel_dim: int = 4, linear_key_head_dim: int = 128, linear_value_head_dim: int = 128,
                 linear_num_key_heads: int = 16, linear_num_value_heads: int = 32, layer_types: list[str] | None = None,
                 full_attention_interval: int = 4, pad_token_id: int | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, **kwargs):
        self.attention_bias, self.partial_rotary_factor = attention_bias, partial_rotary_factor
        self.linear_conv_kernel_dim, self.linear_key_head_dim = linear_conv_kernel_dim, linear_key_head_dim
        self.linear_value_head_dim, self.linear_num_key_heads = linear_value_head_dim, linear_num_key_heads
        self.linear_num_value_heads, self.full_attention_interval = linear_num_value_heads, full_attention_interval
        self.layer_types = list(layer_types or [LINEAR if (i + 1) % full_attention_interval else FULL
                                                for i in range(num_hidden_layers)])
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                         rope_scaling=rope_scaling, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def rope(self, index: int) -> tuple[float, dict | None]:
        """For text the three position streams are one: plain partial rotary (`mrope_*` kept in the
        config, and written back, for a multimodal folder's other inputs)."""
        return self.rope_theta, _text_rotary(self.rope_scaling)

    def mixer(self, index: int) -> GatedDelta:
        return GatedDelta(self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads,
                          self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim,
                          self.rms_norm_eps)

    def attention(self, index: int):
        return replace(super().attention(index), output_gate=True)

    def token_mixer(self, index: int) -> tuple[str, GatedDelta | Attention]:
        return ("linear_attn", self.mixer(index)) if self.layer_types[index] == LINEAR else super().token_mixer(index)

    def validate(self) -> None:
        check_linear_layers(self)
        super().validate()


def check_linear_layers(config) -> None:
    """A hybrid config's `layer_types` name each layer Gated DeltaNet (LINEAR) or attention (FULL), and
    its key heads divide its value heads (each key head serves a run of value heads)."""
    check_layer_kinds("layer_types", config.layer_types, (LINEAR, FULL), config.num_hidden_layers)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ModelConfigError(f"linear_num_value_heads={config.linear_num_value_heads} is not divisible by "
                               f"linear_num_key_heads={config.linear_num_key_heads}")


def _text_rotary(scaling: dict | None) -> dict | None:
    """The multimodal rotary's scaling with its position streams dropped: for text they are equal."""
    if not scaling:
        return scaling
    rest = {key: value for key, value in scaling.items() if key not in _MULTIMODAL_ROTARY}
    return None if rest in ({}, {"rope_type": "default"}) else rest


def fused_linear_inputs(stored: Stored, config: Qwen3_5TextConfig) -> Stored:
    """Where transformers stores our separate q/k/v projections and convs: rows (channels) of its
    fused `in_proj_qkv` and `conv1d`."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if part not in _FUSED_QKV:
        return stored
    name, index = _FUSED_QKV[part]
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    return replace(stored, name=f"{prefix}.{name}.{param}", axis=0, part=index, parts=3, sizes=(keys, keys, values))


class Qwen3_5MoeTextConfig(MoEConfig, Qwen3_5TextConfig):
    model_type = "qwen3_5_moe_text"
    derived_fields = (*Qwen3_5TextConfig.derived_fields, "intermediate_size")  # no dense MLP: transformers has none

    def __init__(self, hidden_size: int = 2048, num_hidden_layers: int = 40, num_key_value_heads: int | None = 2,
                 num_experts: int = 256, num_experts_per_tok: int = 8, moe_intermediate_size: int = 512,
                 shared_expert_intermediate_size: int = 512, **kwargs):
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        super().__init__(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                         num_key_value_heads=num_key_value_heads, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, intermediate_size=kwargs.pop("intermediate_size", 0),
                         **kwargs)

    @property
    def renormalize_topk(self) -> bool:
        return True  # transformers' Qwen3.5-MoE router always divides the top-k by their sum


QWEN3_5_TEXT = decoder_family(Qwen3_5TextConfig, "Qwen3_5ForCausalLM", "qwen3_5", paddlenlp=False,
                              fuse=fused_linear_inputs, accepted={**MTP_FIELDS, **RELEASED_FIELDS}, unread=MTP_UNREAD)
Qwen3_5ForCausalLM, Qwen3_5ForCausalLMPipe = QWEN3_5_TEXT.causal_lm, QWEN3_5_TEXT.pipe
QWEN3_5_MOE_TEXT = decoder_family(Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM", "qwen3_5_moe", paddlenlp=False,
                                  fuse=fused_linear_inputs, accepted={**MOE_ACCEPTED, **MTP_FIELDS, **RELEASED_FIELDS},
                                  unread=MTP_UNREAD)
Qwen3_5MoeForCausalLM, Qwen3_5MoeForCausalLMPipe = QWEN3_5_MOE_TEXT.causal_lm, QWEN3_5_MOE_TEXT.pipe
