"""Mixtral: Mistral's attention with a mixture-of-experts block in every layer, named
`block_sparse_moe` with experts' projections w1 (gate), w3 (up), w2 (down), as wide as
`intermediate_size`; the top-2 weights always renormalised. `router_jitter_noise` (random input
scaling while training) is refused unless 0."""

from __future__ import annotations

from modeling.config_fields import MOE_ACCEPTED, zero
from modeling.decoder_family import decoder_family
from modeling.mistral import MistralConfig
from modeling.moe_config import MoEConfig


class MixtralConfig(MoEConfig, MistralConfig):
    model_type = "mixtral"
    moe_block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    expert_width = "intermediate_size"

    def __init__(self, vocab_size: int = 32000, num_experts: int = 8, num_experts_per_tok: int = 2,
                 rms_norm_eps: float = 1e-5, rope_theta: float = 1000000.0, sliding_window: int | None = None,
                 **kwargs):
        super().__init__(vocab_size=vocab_size, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, sliding_window=sliding_window, **kwargs)

    @property
    def renormalize_topk(self) -> bool:
        return True


MIXTRAL = decoder_family(MixtralConfig, "MixtralForCausalLM", "mixtral", paddlenlp=False,
                         renamed={"num_local_experts": "num_experts"},
                         accepted={**MOE_ACCEPTED, "router_jitter_noise": zero})
MixtralForCausalLM, MixtralForCausalLMPipe = MIXTRAL.causal_lm, MIXTRAL.pipe
