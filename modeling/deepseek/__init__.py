"""DeepSeek-V3/R1 (and Kimi-K2, Moonlight: `deepseek_v3` folders; `kimi_k2` read as one) and
DeepSeek-V2/V2-Lite: multi-head latent attention (`blocks/latent_attention.py`) with yarn rotary on
the rope slice, interleaved pairs, and the softmax scale qk_head_dim^-1/2 x mscale^2; dense MLPs in the
first `first_k_dense_replace` layers, mixtures of experts after them with `n_shared_experts` shared
experts (one ungated MLP as wide as n_shared x `moe_intermediate_size`).

Routing (`blocks/router.py`): V3 (`noaux_tc`) sigmoid scores, `e_score_correction_bias` for choosing
only, `n_group` groups ranked by their top two, `topk_group` kept (the others -inf, as transformers 5
and DeepSeek's current code; transformers 4.55 fills 0.0, which differs only when a kept score plus
its bias is negative), renormalised (+1e-20), times `routed_scaling_factor`; its balance trained by
the aux-loss-free bias update (`--moe_router_bias_update_rate`) and the sequence-wise loss
(`aux_loss_alpha`, 1e-4 when the config is silent, as DeepSeek-V3 trained). V2: softmax scores,
`greedy` or `group_limited_greedy` (groups by their maximum, the others 0.0), never renormalised
(`norm_topk_prob` true is refused: DeepSeek's own V2 code and transformers' disagree on it), times the
scaling; its balance by DeepSeek-V2's expert-level loss with `aux_loss_alpha`: per sequence over the
experts the routing chose when `seq_aux` (its default, as its released configs say; DeepSeek's own V2
code), over the micro-batch (the Switch form) when not. V3's `seq_aux` must be true: its loss is the
sequence-wise one.

`num_nextn_predict_layers` multi-token prediction layers (DeepSeek-V3's layer 61) follow the decoder
(`blocks/prediction.py`), read, trained with weight `num_nextn_predict_lambda`, saved and exported
with the copies of the embedding and head the released folders keep; with 0 a folder's layer 61 is
left unread, as transformers leaves it.
"""

from __future__ import annotations

import math

from modeling.attention_core.spec import CoreSpec
from modeling.blocks.latent_attention import LatentAttention
from modeling.blocks.rotary import Rotary, frozen, rope_type
from modeling.blocks.router import SEQUENCE, SOFTMAX, SWITCH, Routing
from modeling.config import ModelConfigError, check_layer_kinds
from modeling.config_fields import MOE_ACCEPTED, any_value
from modeling.decoder_family import decoder_family
from modeling.moe_config import DeepSeekMoEFields

LATENT_NORM_EPS = 1e-6  # transformers builds the latents' norms with RMSNorm's default, whatever rms_norm_eps says
DENSE, SPARSE = "dense", "sparse"  # mlp_layer_types


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class DeepseekV3Config(DeepSeekMoEFields):
    model_type = "deepseek_v3"
    derived_fields = ("head_dim",)  # ours the q/k head size, transformers' qk_rope_head_dim: each derives its own

    def __init__(self, vocab_size: int = 129280, hidden_size: int = 7168, intermediate_size: int = 18432,
                 num_hidden_layers: int = 61, num_attention_heads: int = 128, num_key_value_heads: int | None = None,
                 kv_lora_rank: int = 512, q_lora_rank: int | None = 1536, qk_rope_head_dim: int = 64,
                 v_head_dim: int = 128, qk_nope_head_dim: int = 128, max_position_embeddings: int = 4096,
                 rope_interleave: bool = True, attention_bias: bool = False, bos_token_id: int | None = 0,
                 eos_token_id: int | None = 1, **kwargs):
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_rope_head_dim, self.v_head_dim, self.qk_nope_head_dim = qk_rope_head_dim, v_head_dim, qk_nope_head_dim
        self.rope_interleave, self.attention_bias = rope_interleave, attention_bias
        kwargs.pop("head_dim", None)  # transformers writes qk_rope_head_dim here; ours is the q/k head size
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, head_dim=qk_nope_head_dim + qk_rope_head_dim,
                         max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)

    @property
    def rotary_interleaved(self) -> bool:
        return self.rope_interleave

    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under a scaled rotary (transformers'
        `yarn_apply_mscale`)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling or {}
        if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
            scale *= _mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        return scale

    def attention(self, index: int) -> LatentAttention:
        return LatentAttention(self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank,
                               self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, LATENT_NORM_EPS,
                               self.attention_bias, CoreSpec(self.softmax_scale()),
                               Rotary(self.qk_rope_head_dim, float(self.rope_theta), frozen(self.rope_scaling or {}),
                                      self.rotary_interleaved, self.max_position_embeddings))

    def validate(self) -> None:
        super().validate()
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelConfigError(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                                   f"{self.num_attention_heads}: latent attention expands k and v for every head")


class MlpLayerTypes:
    """For a DeepSeek-V3-shaped config whose layers are dense or have experts as `mlp_layer_types` says
    ("dense" / "sparse"; GLM-4.7-Flash, Kimi Linear), where DeepSeek-V3 counts `first_k_dense_replace`."""

    num_hidden_layers: int
    mlp_layer_types: list[str]

    def is_dense(self, index: int) -> bool:
        """Layers `mlp_layer_types` calls dense (prediction layers, past the last, have experts)."""
        return index < self.num_hidden_layers and self.mlp_layer_types[index] == DENSE

    def check_mlp_layer_types(self) -> None:
        check_layer_kinds("mlp_layer_types", self.mlp_layer_types, (DENSE, SPARSE), self.num_hidden_layers)


class DeepseekV2Config(DeepseekV3Config):
    model_type = "deepseek_v2"

    def __init__(self, vocab_size: int = 102400, hidden_size: int = 4096, intermediate_size: int = 11008,
                 moe_intermediate_size: int = 1407, num_hidden_layers: int = 32, num_attention_heads: int = 32,
                 n_shared_experts: int = 2, num_experts: int = 64, routed_scaling_factor: float = 1.0,
                 n_group: int | None = None, topk_group: int | None = None, topk_method: str = "greedy",
                 first_k_dense_replace: int = 0, norm_topk_prob: bool = False, max_position_embeddings: int = 2048,
                 aux_loss_alpha: float = 0.001, seq_aux: bool = True, bos_token_id: int | None = 1,
                 eos_token_id: int | None = 2, **kwargs):
        self.topk_method, self.seq_aux = topk_method, seq_aux
        super().__init__(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=num_attention_heads, n_shared_experts=n_shared_experts,
                         num_experts=num_experts, routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                         topk_group=topk_group, first_k_dense_replace=first_k_dense_replace,
                         norm_topk_prob=norm_topk_prob, max_position_embeddings=max_position_embeddings,
                         aux_loss_alpha=aux_loss_alpha, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    @property
    def rotary_interleaved(self) -> bool:
        return True  # V2 rotates interleaved pairs as complex numbers

    def routing(self) -> Routing:
        grouped = self.topk_method == "group_limited_greedy"
        return Routing(self.num_experts_per_tok, SOFTMAX, scale=self.routed_scaling_factor,
                       groups=self.n_group if grouped else 1, kept_groups=self.topk_group if grouped else 1,
                       group_score="max", masked_fill=0.0, aux=SEQUENCE if self.seq_aux else SWITCH,
                       aux_coef=self.aux_loss_alpha, aux_counts_routed=True)

    def validate(self) -> None:
        super().validate()
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"topk_method={self.topk_method!r} is not modelled for DeepSeek-V2 (greedy or "
                                   "group_limited_greedy)")
        if self.norm_topk_prob:
            raise ModelConfigError("norm_topk_prob=true for DeepSeek-V2: transformers never renormalises V2's weights "
                                   "while DeepSeek's own code does; the released configs say false")


def _only(expected):
    return lambda value, _values: value == expected


MTP_LAYERS = "multi-token prediction (num_nextn_predict_layers)"
_SHARED_FIELDS = {**MOE_ACCEPTED, "ep_size": any_value, "qk_head_dim": any_value, "head_dim": any_value,
                  "moe_layer_freq": _only(1)}
# how DeepSeek-V3's folders spell and store it (GLM-4.7-Flash's and Mistral 4's too)
V3_FOLDERS = dict(
    renamed={"n_routed_experts": "num_experts"},
    aliases={"num_local_experts": "num_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    accepted={**_SHARED_FIELDS, "scoring_func": _only("sigmoid"), "topk_method": _only("noaux_tc"),
              "seq_aux": _only(True)}, layers_past_last=MTP_LAYERS, prediction_layers=True)
DEEPSEEK_V3 = decoder_family(DeepseekV3Config, "DeepseekV3ForCausalLM", "deepseek_v3", paddlenlp=False, **V3_FOLDERS)
DEEPSEEK_V2 = decoder_family(
    DeepseekV2Config, "DeepseekV2ForCausalLM", "deepseek_v2", paddlenlp=False,
    renamed={"n_routed_experts": "num_experts"}, aliases={"num_local_experts": "num_experts"},
    accepted={**_SHARED_FIELDS, "scoring_func": _only("softmax"), "mlp_bias": _only(False)})
DeepseekV3ForCausalLM, DeepseekV3ForCausalLMPipe = DEEPSEEK_V3.causal_lm, DEEPSEEK_V3.pipe
DeepseekV2ForCausalLM, DeepseekV2ForCausalLMPipe = DEEPSEEK_V2.causal_lm, DEEPSEEK_V2.pipe
