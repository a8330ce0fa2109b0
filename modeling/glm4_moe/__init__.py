"""GLM-4.5 / GLM-4.5-Air (`glm4_moe`): grouped-query attention with biases on q, k and v (not o),
rotary on the first half of each head (`partial_rotary_factor` 0.5, halves), optional per-head q/k
RMSNorms before rotary (`use_qk_norm`), and DeepSeek-V3's mixture of experts (`moe_config.
DeepSeekMoEFields`: sigmoid routing with a correction bias, groups, shared experts, dense first
layers), and its multi-token prediction layers (`num_nextn_predict_layers`, `blocks/prediction.py`;
transformers 5 writes 1 by default, and drops the layer from its model)."""

from __future__ import annotations

from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.deepseek import MTP_LAYERS
from modeling.moe_config import DeepSeekMoEFields


class Glm4MoeConfig(DeepSeekMoEFields):
    model_type = "glm4_moe"

    def __init__(self, vocab_size: int = 151552, hidden_size: int = 4096, intermediate_size: int = 10944,
                 num_hidden_layers: int = 46, num_attention_heads: int = 96, num_key_value_heads: int | None = 8,
                 head_dim: int | None = None, partial_rotary_factor: float = 0.5,
                 max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5, attention_bias: bool = False,
                 use_qk_norm: bool = False, moe_intermediate_size: int = 1408, num_experts_per_tok: int = 8,
                 n_group: int | None = 1, topk_group: int | None = 1, n_shared_experts: int = 1, num_experts: int = 128,
                 routed_scaling_factor: float = 1.0, first_k_dense_replace: int = 1, norm_topk_prob: bool = True,
                 pad_token_id: int | None = None, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 **kwargs):
        self.partial_rotary_factor, self.attention_bias, self.use_qk_norm = partial_rotary_factor, attention_bias, \
            use_qk_norm
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         moe_intermediate_size=moe_intermediate_size, num_experts_per_tok=num_experts_per_tok,
                         n_group=n_group, topk_group=topk_group, n_shared_experts=n_shared_experts,
                         num_experts=num_experts, routed_scaling_factor=routed_scaling_factor,
                         first_k_dense_replace=first_k_dense_replace, norm_topk_prob=norm_topk_prob,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    @property
    def qk_norm(self) -> str | None:
        return "head" if self.use_qk_norm else None

    @property
    def o_bias(self) -> bool:
        return False


GLM4_MOE = decoder_family(Glm4MoeConfig, "Glm4MoeForCausalLM", "glm4_moe", paddlenlp=False,
                          renamed={"n_routed_experts": "num_experts"},
                          aliases={"num_local_experts": "num_experts", "num_mtp_layers": "num_nextn_predict_layers"},
                          accepted=MOE_ACCEPTED, layers_past_last=MTP_LAYERS, prediction_layers=True)
Glm4MoeForCausalLM, Glm4MoeForCausalLMPipe = GLM4_MOE.causal_lm, GLM4_MOE.pipe
