"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's layers as transformers 5 builds them (latent
attention, the V3 router with its correction bias and groups, shared experts; its attention and
experts the same code), dense or with experts per layer as `mlp_layer_types` says ("dense" / "sparse",
the first layer dense by default) where DeepSeek-V3 counts `first_k_dense_replace`."""

from __future__ import annotations

from modeling.decoder_family import decoder_family
from modeling.deepseek import DENSE, SPARSE, V3_FOLDERS, DeepseekV3Config, MlpLayerTypes

# transformers 5's Glm4MoeLiteConfig defaults (GLM-4.7-Flash's shape) where DeepSeek-V3's differ
DEFAULTS = dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                num_hidden_layers=47, num_attention_heads=20, num_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512,
                q_lora_rank=768, qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
                num_experts_per_tok=4, max_position_embeddings=202752, rms_norm_eps=1e-5, pad_token_id=None)


class Glm4MoeLiteConfig(MlpLayerTypes, DeepseekV3Config):
    model_type = "glm4_moe_lite"

    def __init__(self, mlp_layer_types: list[str] | None = None, **kwargs):
        values = {**DEFAULTS, **kwargs}
        values.pop("first_k_dense_replace", None)
        self.mlp_layer_types = list(mlp_layer_types or [DENSE] + [SPARSE] * (values["num_hidden_layers"] - 1))
        super().__init__(first_k_dense_replace=0, **values)

    def validate(self) -> None:
        self.check_mlp_layer_types()
        super().validate()


GLM4_MOE_LITE = decoder_family(Glm4MoeLiteConfig, "Glm4MoeLiteForCausalLM", "glm4_moe_lite", paddlenlp=False,
                               **V3_FOLDERS)
Glm4MoeLiteForCausalLM, Glm4MoeLiteForCausalLMPipe = GLM4_MOE_LITE.causal_lm, GLM4_MOE_LITE.pipe
