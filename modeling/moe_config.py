"""The fields every mixture-of-experts family shares (transformers' names), and their checks.

A family's config subclass adds its own fields (Qwen's `moe_intermediate_size`, `norm_topk_prob`,
`decoder_sparse_step`, `mlp_only_layers`; Qwen2-MoE's shared expert) or fixes them as class
attributes (Mixtral: every layer sparse, experts as wide as `intermediate_size`, always renormalised).
"""

from __future__ import annotations

from modeling.blocks.mlp import GATED_NAMES, GatedMLP
from modeling.blocks.moe import Experts, MoE, is_sparse
from modeling.blocks.parts import Part
from modeling.config import DecoderConfig, ModelConfigError


class MoEConfig(DecoderConfig):
    moe_block = "mlp"  # the MoE block's name in a decoder layer (Mixtral: block_sparse_moe)
    expert_names = GATED_NAMES  # an expert's projections (Mixtral: w1, w3, w2)
    expert_width = "moe_intermediate_size"  # the config field an expert's width is in
    decoder_sparse_step = 1  # Qwen's fields, fixed where a family has none: every layer sparse
    mlp_only_layers: tuple[int, ...] = ()

    def __init__(self, num_experts: int = 128, num_experts_per_tok: int = 8, router_aux_loss_coef: float = 0.001,
                 **kwargs):
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.router_aux_loss_coef = router_aux_loss_coef
        super().__init__(**kwargs)

    @property
    def renormalize_topk(self) -> bool:
        """The top-k weights divided by their sum (transformers' `norm_topk_prob`)."""
        return bool(getattr(self, "norm_topk_prob", False))

    def feed_forward(self, index: int) -> tuple[str, Part]:
        """A mixture of experts (under `moe_block`) where `is_sparse` says so, else the dense MLP."""
        if not is_sparse(self, index):
            return super().feed_forward(index)
        expert = GatedMLP(self.hidden_size, getattr(self, self.expert_width), self.hidden_act, self.mlp_bias,
                          self.expert_names, unit=self.expert_width)
        width = getattr(self, "shared_expert_intermediate_size", 0)
        shared = GatedMLP(self.hidden_size, width, self.hidden_act, self.mlp_bias,
                          unit="shared_expert_intermediate_size") if width else None
        return self.moe_block, MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.num_experts_per_tok,
                                   shared)

    def validate(self) -> None:
        super().validate()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                   f"num_experts={self.num_experts}")
        if self.decoder_sparse_step < 1:
            raise ModelConfigError(f"decoder_sparse_step={self.decoder_sparse_step} must be at least 1")


class QwenMoEFields(MoEConfig):
    """Qwen's (and OLMoE's) routing and layer-pattern fields."""

    def __init__(self, moe_intermediate_size: int = 768, norm_topk_prob: bool = False, decoder_sparse_step: int = 1,
                 mlp_only_layers: list[int] | None = None, **kwargs):
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        super().__init__(**kwargs)
