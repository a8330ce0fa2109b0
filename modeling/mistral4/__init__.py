"""Mistral 4 (`mistral4`: Mistral Small 4, the text model of Mistral Large 3): DeepSeek-V3's latent
attention (interleaved rotary, yarn's mscale in the softmax scale) with its queries scaled by position
as Llama 4's are, 1 + beta x log(1 + floor(p / original_max_position_embeddings)) (`llama_4_scaling_beta`
in its rope parameters), and experts routed as DeepSeek-V2-style softmax groups: softmax scores, groups
ranked by their top two, the others filled with 0.0, top-k renormalised (+1e-20), times
`routed_scaling_factor`; no correction bias. Its balance by the sequence-wise loss at `aux_loss_alpha`
(transformers computes none). Its experts on disk are transformers 5's fused layout (what transformers
saves for it)."""

from __future__ import annotations

from dataclasses import replace

from modeling.blocks.attention import QueryTemperature
from modeling.blocks.latent_attention import LatentAttention
from modeling.blocks.router import SEQUENCE, SOFTMAX, Routing
from modeling.config import ModelConfigError
from modeling.decoder_family import decoder_family
from modeling.deepseek import V3_FOLDERS, DeepseekV3Config
from modeling.fused_experts import fused_expert_stored
from modeling.moe_config import V3_AUX_ALPHA
from modeling.transformers_adapter import Stored

BETA, ORIGINAL = "llama_4_scaling_beta", "original_max_position_embeddings"
# transformers 5's rotary when a config gives none (Mistral4Config.__post_init__)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 128.0, ORIGINAL: 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale_all_dim": 1.0, "mscale": 1.0, BETA: 0.1}


# transformers 5's Mistral4Config defaults (Mistral Small 4's shape) where DeepSeek-V3's differ
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=36, num_attention_heads=32, num_experts=128, routed_scaling_factor=1.0, kv_lora_rank=256,
                q_lora_rank=1024, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=64, n_group=1, topk_group=1,
                num_experts_per_tok=4, first_k_dense_replace=0, max_position_embeddings=1048576, pad_token_id=11)


class Mistral4Config(DeepseekV3Config):
    model_type = "mistral4"
    experts_stacked = True  # its folders hold transformers 5's fused experts, which has no per-expert form to save

    def __init__(self, rope_scaling: dict | None = None, llama_4_scaling_beta: float | None = None, **kwargs):
        values = {**DEFAULTS, **kwargs}
        qk_rope_head_dim, qk_nope_head_dim = values["qk_rope_head_dim"], values["qk_nope_head_dim"]
        max_position_embeddings = values["max_position_embeddings"]
        share = (rope_scaling or {}).get("partial_rotary_factor")
        if share is not None and not _is_rope_share(share, qk_rope_head_dim, qk_nope_head_dim):
            raise ModelConfigError(f"rope partial_rotary_factor={share}: Mistral 4 rotates the qk_rope_head_dim="
                                   f"{qk_rope_head_dim} channels of each {qk_nope_head_dim + qk_rope_head_dim}-wide head")
        given = rope_scaling is not None or llama_4_scaling_beta is not None or "rope_theta" in values
        # the rope parameters' `max_position_embeddings` is read by nothing (transformers leaves it out of validation);
        # their `partial_rotary_factor` (what qk_rope_head_dim says, checked by `_rope_share`) as a config's is
        scaling = {k: v for k, v in ((rope_scaling or {}) if given else DEFAULT_ROPE).items()
                   if k not in ("max_position_embeddings", "partial_rotary_factor")}
        self.llama_4_scaling_beta = scaling.pop(BETA, llama_4_scaling_beta)
        if self.llama_4_scaling_beta is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling.pop("rope_type", None)  # a default rotary's original length is the scaling's alone
            self.scaling_length = scaling.pop(ORIGINAL, max_position_embeddings)
        else:
            self.scaling_length = scaling.get(ORIGINAL, max_position_embeddings)
        super().__init__(rope_scaling=scaling or None, **values)

    def transformers_spelling(self, values: dict) -> dict:
        """The query scaling's fields and the rotary slice's share of a q/k head back inside the rope
        parameters, where transformers 5 reads them (its rotary sizes itself by that share)."""
        values = dict(values)
        beta = values.pop(BETA)
        scaling = dict(values["rope_scaling"] or {"rope_type": "default"})
        if beta is not None:
            scaling |= {BETA: beta, ORIGINAL: self.scaling_length}
        share = self.qk_rope_head_dim / (self.qk_nope_head_dim + self.qk_rope_head_dim)
        values["rope_scaling"] = {**scaling, "partial_rotary_factor": share}
        return values

    def attention(self, index: int) -> LatentAttention:
        latent = super().attention(index)
        if self.llama_4_scaling_beta is None:
            return latent
        return replace(latent, temperature=QueryTemperature(self.llama_4_scaling_beta, self.scaling_length))

    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, SOFTMAX, renormalize=self.norm_topk_prob, renormalize_eps=1e-20,
                       scale=self.routed_scaling_factor, groups=self.n_group, kept_groups=self.topk_group,
                       masked_fill=0.0, aux=SEQUENCE,
                       aux_coef=V3_AUX_ALPHA if self.aux_loss_alpha is None else self.aux_loss_alpha)


def _rope_share(value, values: dict) -> bool:
    """transformers 5 writes the rotary slice's share of a q/k head as `partial_rotary_factor` (what
    `qk_rope_head_dim` already says), at the top level or inside the rope parameters."""
    return value is None or _is_rope_share(value, values.get("qk_rope_head_dim", 64), values.get("qk_nope_head_dim", 64))


def _is_rope_share(share: float, rope: int, nope: int) -> bool:
    return abs(share - rope / (rope + nope)) < 1e-9


def fused_experts(stored: Stored, config: Mistral4Config) -> Stored:
    """Its experts where transformers 5 saves them (`fused_experts`: stacked, gate and up fused), which has
    no conversion back to one tensor per expert for this family."""
    return fused_expert_stored(stored, config) if ".experts." in stored.name else stored


MISTRAL4 = decoder_family(Mistral4Config, "Mistral4ForCausalLM", "mistral4", paddlenlp=False, fuse=fused_experts,
                          **{**V3_FOLDERS, "accepted": {**V3_FOLDERS["accepted"], "partial_rotary_factor": _rope_share}})
Mistral4ForCausalLM, Mistral4ForCausalLMPipe = MISTRAL4.causal_lm, MISTRAL4.pipe
