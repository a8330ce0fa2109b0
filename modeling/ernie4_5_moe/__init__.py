"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's attention (rotary on interleaved pairs) and, on layers `moe_layer_start_index`..`moe_layer_end_index` every `moe_layer_interval`-th,
`moe_num_experts` experts of `moe_intermediate_size` with `moe_num_shared_experts` shared ones (one
ungated MLP that much wider). Routing as transformers computes it: fp32 softmax scores, the correction
bias (`mlp.moe_statics.e_score_correction_bias`, stored [1, E]) added for choosing only, the `moe_k`
chosen weights divided by their sum clamped below at `moe_norm_min`; the Switch aux loss with
`router_aux_loss_coef`, and the bias moved by the aux-loss-free rule (`--moe_router_bias_update_rate`,
0 freezes it) as for DeepSeek-V3. `use_bias` true is refused by name: transformers' ERNIE 4.5 MoE then
gives the output head a bias too, which is not modelled (the released MoE configs set it false)."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.mlp import GatedMLP
from modeling.blocks.parts import Part
from modeling.blocks.router import CORRECTION_BIAS, SOFTMAX, Routing
from modeling.config import ModelConfigError
from modeling.config_fields import MOE_ACCEPTED
from modeling.decoder_family import decoder_family
from modeling.ernie4_5 import Ernie4_5Config
from modeling.moe_config import MoEConfig, with_shared_experts
from modeling.transformers_adapter import Stored


class Ernie4_5MoeConfig(MoEConfig, Ernie4_5Config):
    model_type = "ernie4_5_moe"
    # transformers 5's in-memory layout (`modeling.fused_experts`) keeps moe_statics inside the gate
    fused_layout_renames = {f"mlp.moe_statics.{CORRECTION_BIAS}": f"mlp.gate.moe_statics.{CORRECTION_BIAS}"}

    def __init__(self, vocab_size: int = 103424, hidden_size: int = 2560, intermediate_size: int = 12288,
                 num_hidden_layers: int = 28, num_attention_heads: int = 20, num_key_value_heads: int | None = 4,
                 head_dim: int | None = None, moe_intermediate_size: int = 1536, num_experts: int = 64,
                 num_experts_per_tok: int = 6, moe_num_shared_experts: int = 2, moe_layer_start_index: int = 1,
                 moe_layer_end_index: int = -1, moe_layer_interval: int = 1, moe_norm_min: float = 1e-12,
                 router_aux_loss_coef: float = 0.001, pad_token_id: int | None = 0, bos_token_id: int | None = 1,
                 eos_token_id: int | None = 2, **kwargs):
        self.moe_intermediate_size, self.moe_num_shared_experts = moe_intermediate_size, moe_num_shared_experts
        self.moe_layer_start_index, self.moe_layer_interval = moe_layer_start_index, moe_layer_interval
        self.moe_layer_end_index = num_hidden_layers - 1 if moe_layer_end_index == -1 else moe_layer_end_index
        self.moe_norm_min = moe_norm_min
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=head_dim, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, router_aux_loss_coef=router_aux_loss_coef,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def sparse(self, index: int) -> bool:
        """transformers' rule for which layers are MoE."""
        return (index + 1) % self.moe_layer_interval == 0 and \
            self.moe_layer_start_index <= index <= self.moe_layer_end_index

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SOFTMAX, renormalize=True, renormalize_floor=self.moe_norm_min,
                       correction_bias=True, correction_rows=1, aux_coef=self.router_aux_loss_coef)

    def feed_forward(self, index: int) -> tuple[str, Part]:
        if not self.sparse(index):
            return "mlp", GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias)
        return "mlp", with_shared_experts(self, index, self.moe_num_shared_experts, self.mlp_bias)

    def validate(self) -> None:
        super().validate()
        if self.moe_layer_interval < 1:
            raise ModelConfigError(f"moe_layer_interval={self.moe_layer_interval} must be at least 1")
        if self.use_bias:
            raise ModelConfigError("use_bias=true: transformers' ERNIE 4.5 MoE then gives the output head a bias, "
                                   "which is not modelled; the released MoE models set it false")


def _statics(stored: Stored, config) -> Stored:
    """transformers keeps the correction bias in its own module, `mlp.moe_statics`, not in the gate."""
    suffix = f"mlp.gate.{CORRECTION_BIAS}"
    return replace(stored, name=stored.name.replace(suffix, f"mlp.moe_statics.{CORRECTION_BIAS}")) \
        if stored.name.endswith(suffix) else stored


ERNIE4_5_MOE = decoder_family(Ernie4_5MoeConfig, "Ernie4_5_MoeForCausalLM", "ernie4_5_moe", paddlenlp=False,
                              fuse=_statics, renamed={"moe_num_experts": "num_experts", "moe_k": "num_experts_per_tok"},
                              aliases={"num_local_experts": "num_experts"}, accepted=MOE_ACCEPTED)
Ernie4_5MoeForCausalLM, Ernie4_5MoeForCausalLMPipe = ERNIE4_5_MOE.causal_lm, ERNIE4_5_MOE.pipe
