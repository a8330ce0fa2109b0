"""The router of a mixture-of-experts layer, configured per family (torchtitan's
`TokenChoiceTopKRouter`, Megatron's `moe_router_*` fields): how a token's router logits become its k
experts and their weights, and what balances the experts.

`Routing` is the family's rule:
- `score`: "softmax" over the experts (Qwen-MoE, Mixtral, OLMoE, DeepSeek-V2), "sigmoid" per expert
  (DeepSeek-V3, GLM-4.5), "softmax_of_top_k" (GPT-OSS: the k largest logits, softmax over them) or
  "sigmoid_of_top_k" (Llama 4: the k largest logits, each through a sigmoid); the balancing statistics
  of the last two read the softmax over all experts;
- `on_input`: the weights scale each expert's input instead of its output (Llama 4), which differs
  since an expert is not linear;
- `correction_bias`: DeepSeek-V3's `e_score_correction_bias`, added to the scores for choosing the
  experts only (the weights are the unbiased scores), moved after each optimizer step by the
  aux-loss-free balancing rule (`paddle_pp/training/expert_balance.py`), never by the optimizer;
- groups: the experts in `groups` equal groups, each scored by the sum of its top two choice scores
  ("top2_sum", V3) or its largest ("max", V2's group_limited_greedy); only the `kept_groups` best
  groups' experts may be chosen, the others' scores filled with `masked_fill` (transformers 5 and
  DeepSeek's current code: -inf; transformers 4.55 and V2: 0.0; they differ when a kept choice score
  is negative);
- `renormalize` (the k weights over their sum, plus `renormalize_eps`, or over at least
  `renormalize_floor`: ERNIE 4.5's `moe_norm_min`), then times `scale` (`routed_scaling_factor`);
- `fp32`: the logits in fp32 (every family but GPT-OSS, whose router runs in the activations' dtype);
- `aux`: the balancing loss injected at the layer, "switch" (E x sum_e f_e x P_e over the micro-batch)
  or "sequence" (DeepSeek-V3 section 2.1.2: the same per sequence, on the sigmoid scores normalised
  over all experts and the top-k of those unbiased scores, averaged over the sequences; with
  `aux_counts_routed`, DeepSeek-V2's `seq_aux`: the experts the routing chose, groups and all),
  times `aux_coef`.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from modeling.autocast import full_precision
from modeling.blocks.attention import l2_norm
from modeling.blocks.parts import Leaf
from modeling.execution import Execution
from modeling.placement import ONES, REPLICATED, ZEROS, Placement, TensorPlan

SOFTMAX, SIGMOID, SOFTMAX_OF_TOP_K, SIGMOID_OF_TOP_K = "softmax", "sigmoid", "softmax_of_top_k", "sigmoid_of_top_k"
SWITCH, SEQUENCE = "switch", "sequence"
CORRECTION_BIAS = "e_score_correction_bias"


@dataclass(frozen=True)
class Routing:
    top_k: int
    score: str = SOFTMAX
    renormalize: bool = False
    renormalize_eps: float = 0.0
    renormalize_floor: float = 0.0
    scale: float = 1.0
    groups: int = 1
    kept_groups: int = 1
    group_score: str = "top2_sum"
    masked_fill: float = float("-inf")
    correction_bias: bool = False
    correction_rows: int = 0  # the bias stored [rows, E] (ERNIE 4.5's moe_statics: [1, E]); 0: [E]
    linear_bias: bool = False
    fp32: bool = True
    aux: str = SWITCH
    aux_coef: float = 0.0
    aux_counts_routed: bool = False
    on_input: bool = False

    def correction_shape(self, experts: int) -> tuple[int, ...]:
        return (self.correction_rows, experts) if self.correction_rows else (experts,)

    def route(self, logits: paddle.Tensor, bias: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor,
                                                                                  paddle.Tensor]:
        """(the scores the balancing statistics read [tokens, E] fp32, chosen experts [tokens, k],
        their weights [tokens, k] fp32) from the router logits (`bias`: the correction bias)."""
        if self.score in (SOFTMAX_OF_TOP_K, SIGMOID_OF_TOP_K):
            top, chosen = paddle.topk(logits, self.top_k, axis=-1)
            weights = F.softmax(top, axis=-1) if self.score == SOFTMAX_OF_TOP_K else F.sigmoid(top.astype("float32"))
            return F.softmax(logits.astype("float32"), axis=-1), chosen, weights.astype("float32")
        scores = F.softmax(logits, axis=-1) if self.score == SOFTMAX else F.sigmoid(logits)
        choice = scores + bias if bias is not None else scores
        if self.groups > 1:
            choice = self._within_kept_groups(choice)
        _, chosen = paddle.topk(choice, self.top_k, axis=-1)
        weights = paddle.take_along_axis(scores, chosen, axis=-1)
        if self.renormalize:
            total = weights.sum(axis=-1, keepdim=True)
            weights = weights / (total.clip(min=self.renormalize_floor) if self.renormalize_floor
                                 else total + self.renormalize_eps)
        return scores, chosen, weights * self.scale if self.scale != 1.0 else weights

    def _group_scores(self, grouped: paddle.Tensor) -> paddle.Tensor:
        """[tokens, groups]: each group's sum of its top two choice scores (V3) or its largest (V2)."""
        return paddle.topk(grouped, 2, axis=-1)[0].sum(-1) if self.group_score == "top2_sum" else grouped.max(-1)

    def _within_kept_groups(self, choice: paddle.Tensor) -> paddle.Tensor:
        """`choice` with the experts outside the `kept_groups` best groups set to `masked_fill`."""
        tokens, experts = choice.shape
        grouped = choice.reshape([tokens, self.groups, experts // self.groups])
        ranked = self._group_scores(grouped)
        kept = paddle.topk(ranked, self.kept_groups, axis=-1)[1]
        mask = paddle.zeros_like(ranked).put_along_axis(kept, paddle.ones_like(kept, "float32"), axis=-1)
        keep = mask.unsqueeze(-1).expand(grouped.shape).reshape([tokens, experts]) > 0
        return paddle.where(keep, choice, paddle.full_like(choice, self.masked_fill))

    def margin(self, scores: paddle.Tensor, bias: paddle.Tensor | None) -> paddle.Tensor:
        """How far routing is from a tie that fp32 noise could flip: the least gap between a token's
        k-th and (k+1)-th choice and, with groups, between the kept_groups-th and next group score
        (softmax scores: the log of their ratio, a router-logit gap; inf when nothing is left out)."""
        choice = scores.detach() + bias if bias is not None else scores.detach()

        def least_gap(values: paddle.Tensor, kept: int) -> paddle.Tensor:
            top = paddle.topk(values, kept + 1, axis=-1)[0]
            first, second = top[:, kept - 1], top[:, kept]
            return (paddle.log(first / second) if self.score != SIGMOID else first - second).min()

        gaps = []
        if self.groups > 1 and self.kept_groups < self.groups:
            gaps.append(least_gap(self._group_scores(choice.reshape([choice.shape[0], self.groups, -1])),
                                  self.kept_groups))
            choice = self._within_kept_groups(choice)
        if self.top_k < choice.shape[-1]:
            gaps.append(least_gap(choice, self.top_k))
        return paddle.stack(gaps).min() if gaps else paddle.full([], float("inf"))

    def aux_loss(self, scores: paddle.Tensor, counts: paddle.Tensor, sequences: int,
                 chosen: paddle.Tensor, parts=None) -> paddle.Tensor:
        """The balancing statistic (1 at balanced routing) over one micro-batch of `sequences` equal
        sequences: scores [tokens, E] fp32, counts [E] (the whole sequences', pooled) and `chosen`
        [tokens, k] the experts chosen. When this rank holds a part of each sequence (`parts`, a
        `modeling.token_parts.TokenParts`: under SP or cp) its sums are pooled over the parts, so the
        statistic is the whole sequences' and each token's scores get their single-card gradient."""
        tokens, experts = scores.shape
        pooled, cut = (lambda x: x, 1) if parts is None else (parts.pooled, parts.degree)  # cut: pieces per sequence
        if self.aux == SWITCH:
            share = counts.astype("float32") / float(tokens * cut * self.top_k)
            return experts * (share * pooled(scores.sum(axis=0)) / float(tokens * cut)).sum()
        normalised = scores / (scores.sum(axis=-1, keepdim=True) + 1e-20)
        per_sequence = normalised.reshape([sequences, tokens // sequences, experts])
        if self.aux_counts_routed:
            chosen = chosen.reshape([sequences, tokens // sequences, self.top_k])
        else:
            chosen = paddle.topk(per_sequence, self.top_k, axis=-1)[1]
        hits = F.one_hot(chosen, experts).sum(axis=2)  # [sequences, tokens, E]: 1 where chosen
        length = float(tokens // sequences * cut)  # each whole sequence's tokens
        share = pooled(hits.sum(axis=1)) / length * experts / self.top_k  # f_i per sequence
        return (share * pooled(per_sequence.sum(axis=1)) / length).sum(-1).mean()


@dataclass(frozen=True)
class Router(Leaf):
    """A linear hidden -> `outputs` (router logits, or Qwen2-MoE's shared-expert gate) stored [hidden,
    outputs], with GPT-OSS's bias and DeepSeek-V3's fp32 correction bias (a buffer: saved and loaded
    by its single-card name, moved by the balancing rule, never by the optimizer) as the routing
    says; whole on every tp rank: every tp rank routes the same tokens, so its gradient is the same."""

    hidden: int
    outputs: int
    routing: Routing | None = None

    def tensors(self) -> dict[str, TensorPlan]:
        rows = {"weight": TensorPlan((self.hidden, self.outputs), Placement(REPLICATED), linear=True)}
        if self.routing is not None and self.routing.linear_bias:
            rows["bias"] = TensorPlan((self.outputs,), Placement(REPLICATED), init=ZEROS)
        if self.routing is not None and self.routing.correction_bias:
            rows[CORRECTION_BIAS] = TensorPlan(self.routing.correction_shape(self.outputs), Placement(REPLICATED),
                                               init=ZEROS, buffer=True)
        return rows

    def build(self, config, run: Execution) -> nn.Layer:
        return RouterLayer(self.hidden, self.outputs, self.routing)


class RouterLayer(nn.Linear):
    def __init__(self, hidden: int, outputs: int, routing: Routing | None):
        super().__init__(hidden, outputs, bias_attr=None if routing is not None and routing.linear_bias else False)
        if routing is not None and routing.correction_bias:
            self.register_buffer(CORRECTION_BIAS, paddle.zeros(list(routing.correction_shape(outputs)), "float32"),
                                 persistable=True)

    @property
    def correction(self) -> paddle.Tensor | None:
        return getattr(self, CORRECTION_BIAS, None)

    def expert_weights(self, weights: paddle.Tensor, chosen: paddle.Tensor) -> paddle.Tensor:
        """The chosen experts' weights as the routing gives them (`ScaledRouterLayer` scales them)."""
        return weights

    def logits(self, flat: paddle.Tensor, fp32: bool) -> paddle.Tensor:
        if not fp32:
            return self(flat)
        with full_precision():
            logits = paddle.matmul(flat.astype("float32"), self.weight.astype("float32"))
            return logits + self.bias.astype("float32") if self.bias is not None else logits


@dataclass(frozen=True)
class ScaledRouter(Leaf):
    """Gemma 4's router: the tokens over their root mean square (no weight), times a learned `scale`
    per channel and hidden^-1/2, through `proj` (in the activations' dtype, the softmax in fp32, as
    transformers computes it); the chosen experts' weights, after the family's renormalisation, times
    their learned `per_expert_scale`. Whole on every tp rank, as `Router`."""

    hidden: int
    outputs: int
    eps: float

    def tensors(self) -> dict[str, TensorPlan]:
        return {"proj.weight": TensorPlan((self.hidden, self.outputs), Placement(REPLICATED), linear=True),
                "scale": TensorPlan((self.hidden,), Placement(REPLICATED), init=ONES),
                "per_expert_scale": TensorPlan((self.outputs,), Placement(REPLICATED), init=ONES)}

    def build(self, config, run: Execution) -> nn.Layer:
        return ScaledRouterLayer(self.hidden, self.outputs, self.eps)


class ScaledRouterLayer(nn.Layer):
    correction = None  # no correction bias

    def __init__(self, hidden: int, outputs: int, eps: float):
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(hidden, outputs, bias_attr=False)
        self.scale = self.create_parameter([hidden], default_initializer=nn.initializer.Constant(1.0))
        self.per_expert_scale = self.create_parameter([outputs], default_initializer=nn.initializer.Constant(1.0))

    def logits(self, flat: paddle.Tensor, fp32: bool) -> paddle.Tensor:
        """fp32 logits of `flat` [tokens, hidden] (`fp32`: the projection too, else in flat's dtype)."""
        scaled = l2_norm(flat, self.eps) * self.scale.astype(flat.dtype) * flat.shape[-1] ** -0.5
        if fp32:
            with full_precision():
                return paddle.matmul(scaled.astype("float32"), self.proj.weight.astype("float32"))
        return self.proj(scaled).astype("float32")

    def expert_weights(self, weights: paddle.Tensor, chosen: paddle.Tensor) -> paddle.Tensor:
        """The chosen experts' weights [tokens, k] times their `per_expert_scale`."""
        return weights * paddle.gather(self.per_expert_scale, chosen.reshape([-1])).reshape(chosen.shape).astype(
            weights.dtype)
