"""MiniMax-M2 (`minimax_m2`: MiniMax-M2, M2.1, M2.5): GQA with RMSNorms over the whole q and k
projections (OLMo-2's, split by heads under tp), the rotary on each head's first `rotary_dim` channels
(`partial_rotary_factor`), and experts in every layer as Mixtral names them (`block_sparse_moe`, w1 w3
w2) routed by sigmoid scores plus a correction bias for choosing only (`e_score_correction_bias`, beside
the router), the chosen scores renormalised. Its balance is the correction bias's
(`--moe_router_bias_update_rate`); transformers adds a balance loss only under `output_router_logits`,
whose statistic ranks experts by the softmax of the router logits while they are chosen by sigmoid plus
bias: refused by name."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.router import SIGMOID, Routing
from modeling.config import DecoderConfig, ModelConfigError
from modeling.config_fields import MOE_ACCEPTED, zero
from modeling.decoder_family import decoder_family
from modeling.moe_config import MoEConfig, refuse_softmax_balance
from modeling.transformers_adapter import Stored

BIAS = "e_score_correction_bias"
# transformers 5's MiniMaxM2Config defaults (MiniMax-M2's shape) where LLaMA's differ
DEFAULTS = dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=196608,
                rms_norm_eps=1e-6, rope_theta=5000000.0, bos_token_id=200034, eos_token_id=200020,
                num_experts=256, num_experts_per_tok=8)


class MiniMaxM2Config(MoEConfig, DecoderConfig):
    model_type = "minimax_m2"
    qk_norm = "projection"
    moe_block = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
    expert_width = "intermediate_size"
    fused_layout_renames = {f".gate.{BIAS}": f".{BIAS}"}  # transformers 5's in-memory layout keeps it on the block

    def __init__(self, rotary_dim: int | None = None, partial_rotary_factor: float | None = None,
                 output_router_logits: bool = False, router_aux_loss_coef: float = 0.001, **kwargs):
        """`rotary_dim` (its released configs') or `partial_rotary_factor` (transformers 5 writes both):
        the rotated channels of each head."""
        values = {**DEFAULTS, **kwargs}
        self.output_router_logits = output_router_logits
        head_dim = values["head_dim"]
        share = rotary_dim / head_dim if rotary_dim is not None else partial_rotary_factor or 1.0
        if partial_rotary_factor is not None and abs(partial_rotary_factor - share) > 1e-9:
            raise ModelConfigError(f"partial_rotary_factor={partial_rotary_factor} disagrees with rotary_dim="
                                   f"{rotary_dim} of head_dim={head_dim}; give one of them")
        self.partial_rotary_factor = share
        super().__init__(router_aux_loss_coef=router_aux_loss_coef, **values)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SIGMOID, renormalize=True, correction_bias=True)

    def validate(self) -> None:
        super().validate()
        refuse_softmax_balance(self, "MiniMax-M2")


def correction_bias(stored: Stored, config: MiniMaxM2Config) -> Stored:
    """Its correction bias beside the router, on the MoE block (our router holds it)."""
    if stored.name.endswith(f".gate.{BIAS}"):
        return replace(stored, name=stored.name.replace(f".gate.{BIAS}", f".{BIAS}"))
    return stored


MINIMAX_M2 = decoder_family(MiniMaxM2Config, "MiniMaxM2ForCausalLM", "minimax_m2", paddlenlp=False,
                            fuse=correction_bias, renamed={"num_local_experts": "num_experts"},
                            accepted={**MOE_ACCEPTED, "router_jitter_noise": zero})
MiniMaxM2ForCausalLM, MiniMaxM2ForCausalLMPipe = MINIMAX_M2.causal_lm, MINIMAX_M2.pipe
