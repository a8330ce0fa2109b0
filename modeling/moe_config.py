"""The fields every mixture-of-experts family shares (transformers' names), and their checks.

A family's config subclass adds its own fields (Qwen's `moe_intermediate_size`, `norm_topk_prob`,
`decoder_sparse_step`, `mlp_only_layers`; Qwen2-MoE's shared expert) or fixes them as class
attributes (Mixtral: every layer sparse, experts as wide as `intermediate_size`, always renormalised).
"""

from __future__ import annotations

from modeling.blocks.mlp import GATED_NAMES, GatedMLP
from modeling.blocks.moe import Experts, MoE, is_sparse
from modeling.blocks.parts import Part
from modeling.blocks.prediction import Prediction
from modeling.blocks.router import SEQUENCE, SIGMOID, Routing
from modeling.config import DecoderConfig, ModelConfigError


class MoEConfig(DecoderConfig):
    moe_block = "mlp"  # the MoE block's name in a decoder layer (Mixtral: block_sparse_moe)
    expert_names = GATED_NAMES  # an expert's projections (Mixtral: w1, w3, w2)
    expert_width = "moe_intermediate_size"  # the config field an expert's width is in
    experts_stacked = False  # its own folders stack the experts (GPT-OSS, Llama 4): they have no other layout
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
        return self.moe_block, MoE(index, self.hidden_size, Experts(self.num_experts, expert), self.routing(), shared)

    def routing(self) -> Routing:
        """transformers' softmax router: top-k of the fp32 probabilities, renormalised as the family
        says, with the Switch aux loss."""
        return Routing(self.num_experts_per_tok, renormalize=self.renormalize_topk, aux_coef=self.router_aux_loss_coef)

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


def with_shared_experts(config, index: int, shared_count: int, bias: bool = False,
                        shared_name: str = "shared_experts", **fields) -> MoE:
    """Layer `index`'s `config.num_experts` experts `moe_intermediate_size` wide, routed as `config.routing()`
    says, beside `shared_count` ungated shared experts run as one MLP that many times as wide (DeepSeek-V3,
    ERNIE 4.5, Hy3; `fields`: the MoE's others)."""
    expert = GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act, bias, config.expert_names,
                      unit="moe_intermediate_size")
    shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * shared_count, config.hidden_act, bias,
                      unit="moe_intermediate_size") if shared_count else None
    return MoE(index, config.hidden_size, Experts(config.num_experts, expert), config.routing(), shared,
               shared_gate=False, names=("gate", shared_name), **fields)


def refuse_softmax_balance(config, name: str) -> None:
    """A sigmoid-routed family balanced by its correction bias (MiniMax-M2, Hy3): transformers adds a
    balance loss only under `output_router_logits`, whose statistic ranks the experts by the softmax of
    the router logits while they are chosen by sigmoid plus the bias: refused by name."""
    if config.output_router_logits:
        raise ModelConfigError(f"output_router_logits=true: {name}'s balance loss in transformers ranks experts by "
                               "the softmax of the router logits while they are chosen by sigmoid plus the correction "
                               "bias (not modelled); set it false and balance by the correction bias "
                               "(--moe_router_bias_update_rate)")


V3_AUX_ALPHA = 1e-4  # DeepSeek-V3's sequence-wise balance weight; its released configs omit aux_loss_alpha


def v3_routing(config, alpha: float | None) -> Routing:
    """DeepSeek-V3's router on `config`'s fields (`num_experts_per_tok`, `norm_topk_prob`,
    `routed_scaling_factor`, `n_group`, `topk_group`): sigmoid scores with a correction bias, groups,
    renormalised, scaled; the sequence-wise balance loss at `alpha` (V3's when None)."""
    return Routing(config.num_experts_per_tok, SIGMOID, renormalize=config.norm_topk_prob, renormalize_eps=1e-20,
                   scale=config.routed_scaling_factor, groups=config.n_group, kept_groups=config.topk_group,
                   correction_bias=True, aux=SEQUENCE, aux_coef=V3_AUX_ALPHA if alpha is None else alpha)


def check_v3_groups(config) -> None:
    """`v3_routing`'s groups: `n_group` divides the experts into groups of at least two (a group is
    ranked by its top two), of which at most `n_group` are kept."""
    if config.num_experts % config.n_group or (config.n_group > 1 and config.num_experts // config.n_group < 2):
        raise ModelConfigError(f"n_group={config.n_group} must divide n_routed_experts={config.num_experts} into "
                               "groups of at least 2 experts (a group is ranked by its top two)")
    if config.topk_group > config.n_group:
        raise ModelConfigError(f"topk_group={config.topk_group} exceeds n_group={config.n_group}")


class DeepSeekMoEFields(MoEConfig):
    """DeepSeek-V3's mixture of experts (also GLM-4.5's): dense MLPs in the first
    `first_k_dense_replace` layers, then experts of `moe_intermediate_size` with `n_shared_experts`
    shared ones (one ungated MLP that much wider), routed by sigmoid scores with a correction bias,
    `n_group` groups of which `topk_group` are kept, renormalised, times `routed_scaling_factor`
    (`blocks/router.py`); balanced by the bias update and the sequence-wise loss (`aux_loss_alpha`,
    1e-4 when the config is silent). `num_nextn_predict_layers` multi-token prediction layers follow
    the decoder (`blocks/prediction.py`; each a decoder layer with experts, as transformers builds
    them), their mean loss weighted by `num_nextn_predict_lambda` in training (PaddleNLP's field and
    its default, 1.0; DeepSeek-V3 trained with 0.3, then 0.1; Megatron's default is 0.1)."""

    moe_block = "mlp"

    def __init__(self, moe_intermediate_size: int = 2048, n_shared_experts: int = 1, num_experts: int = 256,
                 routed_scaling_factor: float = 2.5, n_group: int | None = 8, topk_group: int | None = 4,
                 num_experts_per_tok: int = 8, first_k_dense_replace: int = 3, norm_topk_prob: bool = True,
                 aux_loss_alpha: float | None = None, num_nextn_predict_layers: int = 0,
                 num_nextn_predict_lambda: float = 1.0, **kwargs):
        self.moe_intermediate_size, self.n_shared_experts = moe_intermediate_size, n_shared_experts
        self.routed_scaling_factor, self.n_group, self.topk_group = routed_scaling_factor, n_group or 1, topk_group or 1
        self.first_k_dense_replace, self.norm_topk_prob = first_k_dense_replace, norm_topk_prob
        self.aux_loss_alpha, self.num_nextn_predict_layers = aux_loss_alpha, num_nextn_predict_layers
        self.num_nextn_predict_lambda = num_nextn_predict_lambda
        if kwargs.setdefault("router_aux_loss_coef", 0.0):  # our own saves write the field, as 0.0
            raise ModelConfigError(f"router_aux_loss_coef={kwargs['router_aux_loss_coef']}: a DeepSeek-style model's "
                                   "balance loss weight is aux_loss_alpha; set router_aux_loss_coef to 0 or remove it")
        super().__init__(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, **kwargs)

    def routing(self) -> Routing:
        return v3_routing(self, self.aux_loss_alpha)

    @property
    def mtp_depth(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def mtp_loss_weight(self) -> float:
        """lambda / D: the objective adds the mean of the D depths' losses times lambda."""
        return self.num_nextn_predict_lambda / self.num_nextn_predict_layers if self.num_nextn_predict_layers else 0.0

    def prediction_layer(self, depth: int) -> Prediction:
        """Depth `depth`'s prediction layer around a decoder layer past the last (experts, full attention)."""
        return Prediction.around(self.decoder_layer(self.num_hidden_layers + depth - 1), depth)

    def window(self, index: int) -> int | None:
        return None if index >= self.num_hidden_layers else super().window(index)

    def is_dense(self, index: int) -> bool:
        """Whether layer `index` has a dense MLP: the first `first_k_dense_replace` (prediction layers, past
        the last, have experts)."""
        return index < self.first_k_dense_replace

    def feed_forward(self, index: int) -> tuple[str, Part]:
        if self.is_dense(index):
            return self.moe_block, GatedMLP(self.hidden_size, self.intermediate_size, self.hidden_act)
        return self.moe_block, with_shared_experts(self, index, self.n_shared_experts)

    def validate(self) -> None:
        super().validate()
        check_v3_groups(self)
        if self.num_nextn_predict_layers < 0 or self.num_nextn_predict_lambda < 0:
            raise ModelConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} and "
                                   f"num_nextn_predict_lambda={self.num_nextn_predict_lambda} must not be negative")
