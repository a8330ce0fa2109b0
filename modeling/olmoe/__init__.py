"""OLMoE: LLaMA's layout with mixture-of-experts layers (experts as wide as `intermediate_size`) and
RMSNorms over the whole q and k projections (not per head: under tp each rank keeps its heads' block
of the weight and the mean square is summed over tp, `blocks.norms.SplitRMSNorm`).
`clip_qkv` (clamping q, k and v) is refused unless null."""

from __future__ import annotations

from modeling.config_fields import MOE_ACCEPTED, zero
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig


class OlmoeConfig(MoEConfig):
    model_type = "olmoe"
    qk_norm = "projection"
    expert_width = "intermediate_size"

    def __init__(self, vocab_size: int = 50304, hidden_size: int = 2048, intermediate_size: int = 2048,
                 num_hidden_layers: int = 16, num_attention_heads: int = 16, max_position_embeddings: int = 4096,
                 rms_norm_eps: float = 1e-5, num_experts: int = 64, router_aux_loss_coef: float = 0.01,
                 norm_topk_prob: bool = False, attention_bias: bool = False, **kwargs):
        self.norm_topk_prob = norm_topk_prob
        self.attention_bias = attention_bias
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         num_experts=num_experts, router_aux_loss_coef=router_aux_loss_coef, **kwargs)


OLMOE = decoder_family(OlmoeConfig, "OlmoeForCausalLM", "olmoe", paddlenlp=False,
                       accepted={**MOE_ACCEPTED, "clip_qkv": zero})
OlmoeForCausalLM, OlmoeForCausalLMPipe = OLMOE.causal_lm, OLMOE.pipe
