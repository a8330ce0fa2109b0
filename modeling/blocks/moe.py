"""The mixture-of-experts feed-forward block (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) and its
load-balancing loss.

Routing as transformers computes it: router logits in fp32, softmax, top-k, renormalised iff the
family says so (`renormalize_topk`), the weights cast back to the activations' dtype; each expert
is a gated MLP run on the tokens routed to it, its output times the token's weight added in expert
order (under expert parallelism each rank holds 1/ep of the experts and the rows travel to them:
`modeling/expert_parallel.py`). Dropless: every token reaches its k experts. Every expert runs
every micro-batch, on one zero row with weight zero when no token chose it, so its gradient is a
zero, never missing (what Paddle's fused gradient buffers and the sharded reduction count on).

The aux loss is the Switch form per layer, E * sum_e f_e * P_e times `router_aux_loss_coef`
(f_e: the share of the micro-batch's k x tokens routed to e; P_e: e's mean probability), 1 x the
coefficient at uniform routing. Its gradient is injected where the layer is (`_AddAuxLoss`), scaled
like the main loss (1 / accumulation steps), so it works the same under pipeline parallelism; its
value is kept in the run's `RouterStats` (`modeling/router_stats.py`) for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from modeling.autocast import full_precision
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.parts import Block, Declared, Leaf, Part
from modeling.execution import Execution
from modeling.expert_parallel import run_dispatched
from modeling.tp_plan import REPLICATED, Placement, TensorPlan
from paddle_pp.runtime.experts import mark_experts


@dataclass(frozen=True)
class Router(Leaf):
    """A bias-free linear hidden -> `outputs` (router scores, or Qwen2-MoE's shared-expert gate),
    whole on every tp rank: every tp rank routes the same tokens, so its gradient is the same too."""

    hidden: int
    outputs: int

    def tensors(self) -> dict[str, TensorPlan]:
        return {"weight": TensorPlan((self.hidden, self.outputs), Placement(REPLICATED), linear=True)}

    def build(self, config, run: Execution) -> nn.Layer:
        return nn.Linear(self.hidden, self.outputs, bias_attr=False)


@dataclass(frozen=True)
class Experts(Declared):
    """`count` experts, children "0" .. "count-1" under their global ids (transformers' on-disk names),
    each tensor's placement naming its expert. Under expert parallelism a rank builds only its share,
    under the same global names, so checkpoints keep single-card names whatever the ep."""

    count: int
    expert: GatedMLP

    def parts(self) -> dict[str, Part]:
        return {str(e): self.expert for e in range(self.count)}

    def tensors(self) -> dict[str, TensorPlan]:
        return {name: row.placed(expert=int(name.split(".")[0])) for name, row in super().tensors().items()}

    def built_parts(self, run: Execution) -> dict[str, Part]:
        parts = self.parts()
        return parts if run.experts is None else {str(e): parts[str(e)] for e in run.experts.local(self.count)}


class ExpertsLayer(Block):
    def __init__(self, config, run: Execution, declared: Experts):
        super().__init__(config, run, declared)
        if run.experts is not None:
            mark_experts(self)


Experts.layer = ExpertsLayer


class _AddAuxLoss(PyLayer):
    """Identity on the hidden states whose backward also gives the (already scaled) aux loss the
    gradient 1, as if it were added to the loss: the pipeline's loss lives on another stage."""

    @staticmethod
    def forward(ctx, hidden, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, paddle.ones(ctx.aux_shape, ctx.aux_dtype)


def switch_aux_loss(probs: paddle.Tensor, counts: paddle.Tensor, top_k: int) -> paddle.Tensor:
    """E * sum_e f_e * P_e over one micro-batch's tokens (probs [tokens, E] fp32, counts [E])."""
    tokens, experts = probs.shape
    share = counts.astype("float32") / float(tokens * top_k)
    return experts * (share * probs.mean(axis=0)).sum()


@dataclass(frozen=True)
class MoE(Declared):
    """Decoder layer `index`'s mixture of experts: a router over `experts`, and (Qwen2-MoE) a shared
    expert whose output is gated by sigmoid(shared_expert_gate(x)). Routing reads the family's
    config (top-k, renormalisation, aux-loss coefficient)."""

    index: int
    hidden: int
    experts: Experts
    top_k: int
    shared: GatedMLP | None = None

    def parts(self) -> dict[str, Part]:
        parts: dict[str, Part] = {"gate": Router(self.hidden, self.experts.count), "experts": self.experts}
        if self.shared is not None:
            parts |= {"shared_expert": self.shared, "shared_expert_gate": Router(self.hidden, 1)}
        return parts

    def saved_bytes(self, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        return moe_saved_bytes(self, run, tokens, dtype_bytes)


class SparseMoE(Block):
    """Router, experts and the shared expert of a `MoE` declaration."""

    def __init__(self, config, run: Execution, declared: MoE):
        """Its linears are plain tp ones even under sequence parallelism: the block gathers the
        sequence first (see `forward`)."""
        super().__init__(config, replace(run, sequence_parallel=False), declared)
        self.sequence_first = run.sequence_first
        self.layer_index = declared.index  # its decoder layer's, for the metrics

    def route(self, flat: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """(fp32 probabilities [tokens, E], chosen experts [tokens, k], their weights [tokens, k])."""
        c = self.config
        with full_precision():
            probs = F.softmax(paddle.matmul(flat.astype("float32"), self.gate.weight.astype("float32")), axis=-1)
            weights, chosen = paddle.topk(probs, c.num_experts_per_tok, axis=-1)
            if c.renormalize_topk:
                weights = weights / weights.sum(axis=-1, keepdim=True)
        return probs, chosen, weights.astype(flat.dtype)

    def forward(self, hidden):
        """Under sequence parallelism every tp rank gathers the whole sequence (backward: keeps its
        positions' gradient, each rank computing the whole one), routes and computes it as plain tp
        does (the experts' row linears all-reduce), then keeps its own positions (backward: gathers
        the gradient). Dense layers reduce-scatter instead of all-reducing: MoE layers under SP move
        a sequence's activations once more, for routing whole tokens without a second exchange."""
        if self.sequence_first:
            return sp_utils.ScatterOp.apply(self._forward(sp_utils.GatherOp.apply(hidden)))
        return self._forward(hidden)

    def _forward(self, hidden):
        c = self.config
        flat = hidden.reshape([-1, c.hidden_size])
        probs, chosen, weights = self.route(flat)
        out, counts = (self._local(flat, chosen, weights) if self.run.experts is None
                       else run_dispatched(flat, chosen, weights, self.experts, self.run.experts,
                                           self.declared.experts.count))
        if hasattr(self, "shared_expert"):
            out = out + F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        out = out.reshape(hidden.shape)
        if self.training and paddle.is_grad_enabled():  # not in evaluation (under no_grad, in train mode too)
            counts = paddle.to_tensor(counts, "int64")
            aux = switch_aux_loss(probs, counts, c.num_experts_per_tok) * c.router_aux_loss_coef
            self.run.router_stats.record(self.layer_index, aux, counts, tie_margin(probs, c.num_experts_per_tok))
            if c.router_aux_loss_coef:
                out = _AddAuxLoss.apply(out, aux / self.run.accumulate_steps)
        return out

    def _local(self, flat, chosen, weights) -> tuple[paddle.Tensor, list[int]]:
        """Every expert on this rank: each runs on its tokens, its weighted output added in expert order."""
        out, counts = paddle.zeros_like(flat), []
        for e, expert in enumerate(self.experts.children()):
            hit = chosen == e
            token = paddle.nonzero(hit)[:, 0]
            counts.append(token.shape[0])
            if token.shape[0]:
                routed, weight = paddle.gather(flat, token), paddle.masked_select(weights, hit).unsqueeze(-1)
            else:  # no token chose it: a zero row with weight zero keeps its gradient a zero
                token = paddle.zeros([1], "int64")
                routed, weight = paddle.zeros([1, flat.shape[1]], flat.dtype), paddle.zeros([1, 1], flat.dtype)
            out = paddle.index_add(out, token, 0, expert(routed) * weight)
        return out, counts


MoE.layer = SparseMoE


def tie_margin(probs: paddle.Tensor, top_k: int) -> paddle.Tensor:
    """The least gap between a token's k-th and (k+1)-th router logit (log of the probabilities'
    ratio): how far routing is from a tie that fp32 noise could flip (inf when every expert is chosen)."""
    if top_k == probs.shape[-1]:
        return paddle.full([], float("inf"))
    top = paddle.topk(probs.detach(), top_k + 1, axis=-1)[0]
    return paddle.log(top[:, top_k - 1] / top[:, top_k]).min()


def is_sparse(c, index: int) -> bool:
    """transformers' rule: layer `index` is MoE unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (Mixtral and OLMoE: every layer)."""
    return c.num_experts > 0 and index not in (c.mlp_only_layers or ()) and (index + 1) % c.decoder_sparse_step == 0


def moe_saved_bytes(moe: MoE, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
    """What an MoE block keeps for backward with balanced routing (each expert gets tokens x k / E):
    the router's input and fp32 probabilities, each expert's gated-MLP activations on its tokens, the
    gathered rows and the weighted outputs (the planner's model; not measured)."""
    routed = tokens * moe.top_k
    expert = moe.experts.expert.saved_bytes(run, routed, dtype_bytes)
    saved = {"gate": tokens * moe.hidden * dtype_bytes + tokens * moe.experts.count * 4,
             "experts": sum(expert.values()) + 2 * routed * moe.hidden * dtype_bytes}
    if moe.shared is not None:
        shared = moe.shared.saved_bytes(run, tokens, dtype_bytes)
        saved["shared_expert"] = sum(shared.values()) + 2 * tokens * moe.hidden * dtype_bytes
    return saved
