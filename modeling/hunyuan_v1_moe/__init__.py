"""Hunyuan MoE (Tencent Hunyuan-A13B, `hunyuan_v1_moe`): Hunyuan dense's attention (q/k norms on the
rotated heads, the fixed-alpha NTK rotary) with experts in every layer, `intermediate_size` wide, routed
by a softmax top-`moe_topk` renormalised (its router `gate.wg`, fp32), beside an ungated shared MLP
(`shared_mlp`) as wide. Per-layer expert counts or top-k (lists) are refused by name."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.mlp import GatedMLP
from modeling.blocks.parts import Part
from modeling.config import ModelConfigError
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.hunyuan_v1_dense import HunYuanDenseV1Config
from modeling.moe_config import MoEConfig
from modeling.transformers_adapter import Stored


class HunYuanMoEV1Config(MoEConfig, HunYuanDenseV1Config):
    model_type = "hunyuan_v1_moe"
    expert_width = "intermediate_size"
    derived_fields = ("num_experts_per_tok",)  # its folders' `moe_topk`

    def __init__(self, num_experts: int | list[int] = 1, moe_topk: int | list[int] = 1, **kwargs):
        self.moe_topk = moe_topk
        kwargs.pop("num_experts_per_tok", None)
        super().__init__(num_experts=num_experts, num_experts_per_tok=moe_topk, **kwargs)

    @property
    def renormalize_topk(self) -> bool:
        return True

    def feed_forward(self, index: int) -> tuple[str, Part]:
        name, moe = super().feed_forward(index)
        shared = GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act)
        return name, replace(moe, shared=shared, shared_gate=False, names=("gate", "shared_mlp"))

    def validate(self) -> None:
        for name in ("num_experts", "moe_topk"):
            if not isinstance(getattr(self, name), int):
                raise ModelConfigError(f"{name}={getattr(self, name)!r}: a count per layer is not modelled; give one "
                                       "number for every layer")
        super().validate()


def router_weight(stored: Stored, config: HunYuanMoEV1Config) -> Stored:
    """Its router's weight under `gate.wg`."""
    if stored.name.endswith(".mlp.gate.weight"):
        return replace(stored, name=stored.name.removesuffix(".weight") + ".wg.weight")
    return stored


HUNYUAN_V1_MOE = decoder_family(HunYuanMoEV1Config, "HunYuanMoEV1ForCausalLM", "hunyuan_moe", paddlenlp=False,
                                fuse=router_weight, renamed={"num_local_experts": "num_experts"},
                                accepted={**MOE_ACCEPTED, "eod_token_id": any_value, "sep_token_id": any_value})
HunYuanMoEV1ForCausalLM, HunYuanMoEV1ForCausalLMPipe = HUNYUAN_V1_MOE.causal_lm, HUNYUAN_V1_MOE.pipe
