"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's layers as transformers 5 builds them (latent
attention, the V3 router with its correction bias and groups, shared experts; its attention and
experts the same code), dense or with experts per layer as `mlp_layer_types` says ("dense" / "sparse",
the first layer dense by default) where DeepSeek-V3 counts `first_k_dense_replace`."""

from __future__ import annotations

from modeling.decoder_family import decoder_family
from modeling.deepseek import DENSE, SPARSE, V3_FOLDERS, DeepseekV3Config, MlpLayerTypes


class Glm4MoeLiteConfig(MlpLayerTypes, DeepseekV3Config):
    model_type = "glm4_moe_lite"

    def __init__(self, vocab_size: int = 154880, hidden_size: int = 2048, intermediate_size: int = 10240,
                 moe_intermediate_size: int = 1536, num_hidden_layers: int = 47, num_attention_heads: int = 20,
                 num_experts: int = 64, routed_scaling_factor: float = 1.8, kv_lora_rank: int = 512,
                 q_lora_rank: int | None = 768, qk_rope_head_dim: int = 64, v_head_dim: int = 256,
                 qk_nope_head_dim: int = 192, n_group: int | None = 1, topk_group: int | None = 1,
                 num_experts_per_tok: int = 4, max_position_embeddings: int = 202752, rms_norm_eps: float = 1e-5,
                 pad_token_id: int | None = None, mlp_layer_types: list[str] | None = None, **kwargs):
        self.mlp_layer_types = list(mlp_layer_types or [DENSE] + [SPARSE] * (num_hidden_layers - 1))
        kwargs.pop("first_k_dense_replace", None)
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, num_experts=num_experts,
                         routed_scaling_factor=routed_scaling_factor, kv_lora_rank=kv_lora_rank,
                         q_lora_rank=q_lora_rank, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                         qk_nope_head_dim=qk_nope_head_dim, n_group=n_group, topk_group=topk_group,
                         num_experts_per_tok=num_experts_per_tok, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=rms_norm_eps, pad_token_id=pad_token_id, first_k_dense_replace=0, **kwargs)

    def validate(self) -> None:
        self.check_mlp_layer_types()
        super().validate()


GLM4_MOE_LITE = decoder_family(Glm4MoeLiteConfig, "Glm4MoeLiteForCausalLM", "glm4_moe_lite", paddlenlp=False,
                               **V3_FOLDERS)
Glm4MoeLiteForCausalLM, Glm4MoeLiteForCausalLMPipe = GLM4_MOE_LITE.causal_lm, GLM4_MOE_LITE.pipe
