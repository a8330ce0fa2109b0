"""Kimi Linear (`kimi_linear`: Kimi-Linear-48B-A3B): Kimi Delta Attention layers (`linear_attention`:
Gated DeltaNet with a decay per key channel, `blocks/gated_delta.KimiDelta`) beside latent attention
without rotary (`full_attention`: DeepSeek-V3's MLA with its rope slice left unrotated, scale
qk_head_dim^-1/2), and DeepSeek-V3's mixture of experts (sigmoid routing with a correction bias, shared
experts, `routed_scaling_factor`) after dense MLPs, each layer's by `mlp_layer_types` (from
`first_k_dense_replace` when absent). Both mixers sit under `self_attn`, both feed-forward kinds under
`block_sparse_moe` (experts' projections w1, w3, w2, as Mixtral's).

`linear_attn_config` is where the released configs put the layer pattern (`kda_layers`,
`full_attn_layers`: 1-based) and the mixer's `num_heads`, `head_dim` and `short_conv_kernel_size`; as
in transformers, its sizes win over the `linear_*` fields and `layer_types`, when given, over its
pattern. The config's other spellings (`model_max_length`, `num_expert_group`,
`num_experts_per_token`, `num_shared_experts`, `moe_renormalize`) are transformers' attribute map's."""

from __future__ import annotations

from dataclasses import replace

from modeling.attention_core.spec import CoreSpec
from modeling.blocks.gated_delta import KimiDelta, stored_apart
from modeling.blocks.latent_attention import LatentAttention
from modeling.config import FULL, ModelConfigError, check_layer_kinds
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.deepseek import DENSE, SPARSE, DeepseekV3Config, MlpLayerTypes
from modeling.qwen3_5 import LINEAR
from modeling.transformers_adapter import Stored

_PATTERN_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"}


class KimiLinearConfig(MlpLayerTypes, DeepseekV3Config):
    model_type = "kimi_linear"
    # no rotary anywhere: the rotary fields a DeepSeek config carries are not Kimi Linear's
    derived_fields = (*DeepseekV3Config.derived_fields, "rope_theta", "rope_scaling", "rope_interleave")
    moe_block = "block_sparse_moe"  # the dense MLPs' name too
    expert_names = ("w1", "w3", "w2")

    def __init__(self, vocab_size: int = 163840, hidden_size: int = 2304, intermediate_size: int = 9216,
                 moe_intermediate_size: int = 1024, num_hidden_layers: int = 27, num_attention_heads: int = 32,
                 num_key_value_heads: int | None = 32, num_experts: int = 256, n_shared_experts: int = 1,
                 routed_scaling_factor: float = 2.446, kv_lora_rank: int = 512, q_lora_rank: int | None = None,
                 n_group: int | None = 1, topk_group: int | None = 1, first_k_dense_replace: int = 1,
                 max_position_embeddings: int = 1048576, rms_norm_eps: float = 1e-5, pad_token_id: int | None = 163839,
                 bos_token_id: int | None = 163584, eos_token_id: int | None = 163586,
                 layer_types: list[str] | None = None, mlp_layer_types: list[str] | None = None,
                 linear_attn_config: dict | None = None, linear_head_dim: int = 128, linear_num_heads: int = 32,
                 linear_conv_kernel_dim: int = 4, **kwargs):
        pattern = dict(linear_attn_config or {})
        self.linear_attn_config = linear_attn_config
        self.linear_head_dim = pattern.get("head_dim", linear_head_dim)
        self.linear_num_heads = pattern.get("num_heads", linear_num_heads)
        self.linear_conv_kernel_dim = pattern.get("short_conv_kernel_size", linear_conv_kernel_dim)
        if layer_types is None and {"kda_layers", "full_attn_layers"} <= set(pattern):
            layer_types = [None] * num_hidden_layers
            for layers, kind in ((pattern["full_attn_layers"], FULL), (pattern["kda_layers"], LINEAR)):
                for layer in layers:
                    if 1 <= layer <= num_hidden_layers:
                        layer_types[layer - 1] = kind
        self.layer_types = list(layer_types or [FULL if i and i % 4 == 0 else LINEAR for i in range(num_hidden_layers)])
        self.mlp_layer_types = list(mlp_layer_types or [DENSE if i < first_k_dense_replace else SPARSE
                                                        for i in range(num_hidden_layers)])
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                         num_experts=num_experts, n_shared_experts=n_shared_experts,
                         routed_scaling_factor=routed_scaling_factor, kv_lora_rank=kv_lora_rank,
                         q_lora_rank=q_lora_rank, n_group=n_group, topk_group=topk_group,
                         first_k_dense_replace=first_k_dense_replace, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)

    def attention(self, index: int) -> LatentAttention:
        """Latent attention with its rope slice unrotated."""
        return replace(super().attention(index), spec=CoreSpec((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5),
                       rotary=None)

    def token_mixer(self, index: int) -> tuple[str, KimiDelta | LatentAttention]:
        if self.layer_types[index] != LINEAR:
            return super().token_mixer(index)
        return "self_attn", KimiDelta(self.hidden_size, self.linear_num_heads, self.linear_num_heads,
                                      self.linear_head_dim, self.linear_head_dim, self.linear_conv_kernel_dim,
                                      self.rms_norm_eps)

    def validate(self) -> None:
        if self.num_nextn_predict_layers:
            raise ModelConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: Kimi Linear has no "
                                   "multi-token prediction layers (transformers builds none, its releases hold none); "
                                   "set it to 0")
        unknown = sorted(set(self.linear_attn_config or {}) - _PATTERN_KEYS)
        if unknown:
            raise ModelConfigError(f"linear_attn_config has {', '.join(unknown)}, which paddle-pp does not model "
                                   f"(it reads {', '.join(sorted(_PATTERN_KEYS))})")
        check_layer_kinds("layer_types (or linear_attn_config's kda_layers and full_attn_layers)", self.layer_types,
                          (LINEAR, FULL), self.num_hidden_layers)
        self.check_mlp_layer_types()
        super().validate()


def stored_names(stored: Stored, config: KimiLinearConfig) -> Stored:
    """Its folders' names of the Kimi Delta mixer's parts (`stored_apart`: its linear layers' `self_attn`)."""
    return stored_apart(stored, "self_attn")


KIMI_LINEAR = decoder_family(
    KimiLinearConfig, "KimiLinearForCausalLM", "kimi_linear", paddlenlp=False,
    renamed={"model_max_length": "max_position_embeddings", "num_expert_group": "n_group",
             "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
             "moe_renormalize": "norm_topk_prob"},
    accepted={**MOE_ACCEPTED, "head_dim": any_value, "qk_head_dim": any_value}, fuse=stored_names)
KimiLinearForCausalLM, KimiLinearForCausalLMPipe = KIMI_LINEAR.causal_lm, KIMI_LINEAR.pipe
