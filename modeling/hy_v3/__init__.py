"""Hy3 (`hy_v3`: Tencent's Hy3-preview), as transformers 5 builds it: LLaMA's layers with per-head
q/k RMSNorms before the rotary (Apertus's attention), a dense first layer and experts after it as
`mlp_layer_types` says, DeepSeek-V3's router without groups (sigmoid scores plus a correction bias for
choosing only, the chosen scores over their sum, times `router_scaling_factor`) and ungated shared
experts `num_shared_experts` x `moe_intermediate_size` wide, added in fp32 under
`enable_moe_fp32_combine`. Its balance is the correction bias's (`--moe_router_bias_update_rate`);
transformers' balance loss under `output_router_logits` ranks experts by the softmax of the logits
they are not chosen by: refused by name, as MiniMax-M2's.

On disk (its conversion of the in-memory names, which transformers writes by default): the router
`mlp.router.gate`, the correction bias `mlp.expert_bias`, the shared experts `mlp.shared_mlp`, the
experts one by one; a folder re-saved in transformers' in-memory layout (`mlp.gate`,
`mlp.e_score_correction_bias`, `mlp.shared_experts`, stacked experts) is read too.
"""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.mlp import GatedMLP
from modeling.blocks.parts import Part
from modeling.blocks.router import CORRECTION_BIAS, SIGMOID, Routing
from modeling.config import check_layer_kinds
from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig, refuse_softmax_balance, with_shared_experts
from modeling.transformers_adapter import Stored

DENSE, SPARSE = "dense", "sparse"
SHARED = "shared_mlp"
# what transformers' default save writes for our names (its conversion of the in-memory layout), by suffix
ON_DISK = {f".mlp.gate.{CORRECTION_BIAS}": ".mlp.expert_bias", ".mlp.gate.weight": ".mlp.router.gate.weight"}


class HYV3Config(MoEConfig):
    model_type = "hy_v3"
    qk_norm = "head"
    # the in-memory layout's names for the default save's (`fused_experts`)
    fused_layout_renames = {".expert_bias": f".{CORRECTION_BIAS}", ".router.gate.weight": ".gate.weight",
                            **{f".{SHARED}.{name}.weight": f".shared_experts.{name}.weight"
                               for name in ("gate_proj", "up_proj", "down_proj")}}

    def __init__(self, vocab_size: int = 120832, hidden_size: int = 4096, intermediate_size: int = 13312,
                 num_hidden_layers: int = 80, num_attention_heads: int = 64, num_key_value_heads: int | None = 8,
                 head_dim: int | None = 128, max_position_embeddings: int = 131072, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 11158840.0, initializer_range: float = 0.006, attention_bias: bool = False,
                 mlp_bias: bool = False, num_experts: int = 192, num_experts_per_tok: int = 8,
                 num_shared_experts: int = 1, moe_intermediate_size: int = 1536, router_scaling_factor: float = 2.826,
                 enable_moe_fp32_combine: bool = True, mlp_layer_types: list[str] | None = None,
                 output_router_logits: bool = False, pad_token_id: int | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, **kwargs):
        self.attention_bias, self.mlp_bias = attention_bias, mlp_bias
        self.num_shared_experts, self.moe_intermediate_size = num_shared_experts, moe_intermediate_size
        self.router_scaling_factor, self.enable_moe_fp32_combine = router_scaling_factor, enable_moe_fp32_combine
        self.mlp_layer_types = list(mlp_layer_types or [DENSE] * min(num_hidden_layers, 1)
                                    + [SPARSE] * max(num_hidden_layers - 1, 0))
        self.output_router_logits = output_router_logits
        kwargs.setdefault("router_aux_loss_coef", 0.0)  # none: the correction bias balances (our saves write it)
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
                         rope_theta=rope_theta, initializer_range=initializer_range, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, pad_token_id=pad_token_id,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SIGMOID, renormalize=True, renormalize_eps=1e-20,
                       scale=self.router_scaling_factor, correction_bias=True)

    def feed_forward(self, index: int) -> tuple[str, Part]:
        if self.mlp_layer_types[index] == DENSE:
            return "mlp", GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias)
        return "mlp", with_shared_experts(self, index, self.num_shared_experts, self.mlp_bias, SHARED,
                                          fp32_combine=self.enable_moe_fp32_combine)

    def validate(self) -> None:
        super().validate()
        check_layer_kinds("mlp_layer_types", self.mlp_layer_types, (DENSE, SPARSE), self.num_hidden_layers)
        refuse_softmax_balance(self, "Hy3")


def on_disk(stored: Stored, config: HYV3Config) -> Stored:
    """Where transformers' default save keeps our router and its correction bias (`ON_DISK`)."""
    for ours, theirs in ON_DISK.items():
        if stored.name.endswith(ours):
            return replace(stored, name=stored.name.removesuffix(ours) + theirs)
    return stored


HY_V3 = decoder_family(HYV3Config, "HYV3ForCausalLM", "hy_v3", paddlenlp=False, fuse=on_disk,
                       renamed={"num_local_experts": "num_experts"}, accepted=MOE_ACCEPTED)
HYV3ForCausalLM, HYV3ForCausalLMPipe = HY_V3.causal_lm, HY_V3.pipe
