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
coefficient at uniform routing. Its gradient is injected where the layer is (`injected_loss`), scaled
like the main loss (1 / accumulation steps), so it works the same under pipeline parallelism; its
value is kept in the run's `RouterStats` (`modeling/router_stats.py`) for the metrics. Under context
parallelism a rank routes its part of each sequence: the counts and the statistics' sums are pooled
over the ring first, so the aux loss, the recorded loads and the correction-bias updates are the
whole sequences', as on one card.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from modeling import tp_gradients
from modeling.autocast import full_precision
from modeling.blocks.mlp import GatedMLP, PlainMLP
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, Declared, Norm, Part, WholeLinear
from modeling.blocks.router import Router, Routing
from modeling.execution import Execution, recomputing
from modeling.expert_parallel import run_dispatched, run_experts, run_experts_over_tp
from modeling.injected_loss import inject
from modeling.placement import TensorPlan
from modeling.sequence_parallel import sequence_shards
from modeling.token_parts import token_parts
from paddle_pp.runtime.experts import mark_experts


@dataclass(frozen=True)
class Experts(Declared):
    """`count` experts, children "0" .. "count-1" under their global ids (transformers' on-disk names),
    each tensor's placement naming its expert. Under expert parallelism a rank builds only its share,
    under the same global names, so checkpoints keep single-card names whatever the ep."""

    count: int
    expert: GatedMLP | PlainMLP

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


EXPERT_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")  # the experts' input's, their sum's


@dataclass(frozen=True)
class MoE(Declared):
    """Decoder layer `index`'s mixture of experts: a router over `experts` routing as the family's
    `Routing` says, and a shared expert (Qwen2-MoE's gated by sigmoid(shared_expert_gate(x)),
    DeepSeek's `shared_experts` ungated) whose output is added; `names` are the router's and the
    shared expert's (transformers' names of the family). With `latent` (Nemotron-H's latent MoE) the
    routed tokens go down to that width before the experts (`fc1_latent_proj`, whole on every tp rank)
    and their weighted sum back up after (`fc2_latent_proj`); the router and the shared expert read
    the hidden states. With `norms` (Gemma 4's) the experts' input and their weighted sum are each
    normalised (`EXPERT_NORMS`), the router reading the hidden states as they come; `router` replaces
    the linear router (Gemma 4's `ScaledRouter`)."""

    index: int
    hidden: int
    experts: Experts
    routing: Routing
    shared: GatedMLP | PlainMLP | None = None
    shared_gate: bool = True
    names: tuple[str, str] = ("gate", "shared_expert")
    latent: int | None = None
    norms: Norm | None = None
    router: Part | None = None
    fp32_combine: bool = False  # the shared expert's output added in fp32 (Hy3's enable_moe_fp32_combine)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def parts(self) -> dict[str, Part]:
        router, shared = self.names
        parts: dict[str, Part] = {router: self.router or Router(self.hidden, self.experts.count, self.routing),
                                  "experts": self.experts}
        if self.norms is not None:
            parts |= dict.fromkeys(EXPERT_NORMS, self.norms)
        if self.shared is not None:
            parts[shared] = self.shared
            if self.shared_gate:
                parts[f"{shared}_gate"] = Router(self.hidden, 1)
        if self.latent is not None:
            parts |= {"fc1_latent_proj": WholeLinear(self.hidden, self.latent),
                      "fc2_latent_proj": WholeLinear(self.latent, self.hidden)}
        return parts

    def saved_bytes(self, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        return moe_saved_bytes(self, run, tokens, dtype_bytes)


class SparseMoE(Block):
    """Router, experts and the shared expert of a `MoE` declaration.

    Under sequence parallelism each tp rank routes and dispatches its own positions (Megatron's way):
    its rows travel to their experts' ranks, the rows each tp rank received are gathered over tp once
    for the experts (whose projections are split over tp as without SP), and each tp rank gets its
    rows' summed outputs back by one reduce-scatter (`run_experts_over_tp`), so a rank sends 1/tp of
    the rows it would send for the gathered sequence; the shared expert's tokens ride in the same
    all-gather and reduce-scatter (one collective pair per layer). The router (and the shared
    expert's gate) then sees this rank's positions only: its gradient is summed over tp like a
    norm's, and the routing statistics are pooled over the tp ranks (`modeling.token_parts`)."""

    def __init__(self, config, run: Execution, declared: MoE):
        """Its linears are plain tp ones even under sequence parallelism: the block moves their rows."""
        super().__init__(config, replace(run, sequence_parallel=False), declared)
        self.sequence_first = run.sequence_first
        self.layer_index = declared.index  # its decoder layer's, for the metrics
        self.parts = token_parts(run.tp_group if run.sequence_first else None, run.ring)
        if run.sequence_first:
            tp_gradients.mark(self.router_layer, run)
            if declared.shared is not None and declared.shared_gate:
                tp_gradients.mark(getattr(self, f"{declared.names[1]}_gate"), run)
            if declared.latent is not None:  # on this rank's positions, as the router
                tp_gradients.mark(self.fc1_latent_proj, run)
                tp_gradients.mark(self.fc2_latent_proj, run)
            for name in EXPERT_NORMS if declared.norms is not None else ():  # the same
                tp_gradients.mark(getattr(self, name), run)
            shared = [getattr(self, declared.names[1])] if declared.shared is not None else []
            for expert in [*self.experts.children(), *shared]:  # a bias after the sum: added to this rank's rows
                down = getattr(expert, expert.declared.names[-1])
                if down.bias is not None:
                    sp_utils.mark_as_sequence_parallel_parameter(down.bias)

    def partial_projections(self) -> list[nn.Layer]:
        """The projections this block runs as partial sums (`run_experts_over_tp`, under SP): its experts' and
        its shared expert's (their LoRA adapters add their terms there, without collectives)."""
        if not self.sequence_first:
            return []
        shared = [getattr(self, self.declared.names[1])] if self.declared.shared is not None else []
        return [getattr(expert, name) for expert in [*self.experts.children(), *shared]
                for name in expert.declared.names]

    @property
    def router_layer(self):
        return getattr(self, self.declared.names[0])

    def route(self, flat: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """(fp32 scores [tokens, E], chosen experts [tokens, k], their weights [tokens, k] in the
        activations' dtype)."""
        routing = self.declared.routing
        logits = self.router_layer.logits(flat, routing.fp32)
        with full_precision():
            scores, chosen, weights = routing.route(logits, self.router_layer.correction)
            weights = self.router_layer.expert_weights(weights, chosen)
        return scores, chosen, weights.astype(flat.dtype)

    def forward(self, hidden):
        """The layer on this rank's tokens (under SP its positions, [seq / tp, batch, hidden])."""
        declared = self.declared
        flat = hidden.reshape([-1, declared.hidden])
        scores, chosen, weights = self.route(flat)
        shared_layer = getattr(self, declared.names[1]) if declared.shared is not None else None
        shared_out = None

        def compute(rows: paddle.Tensor, counts: list[int]) -> tuple[paddle.Tensor | None, paddle.Tensor]:
            """This rank's experts on `rows` sorted by expert (`counts` each); under SP with the other tp
            ranks' rows and the shared expert in the same collectives (`run_experts_over_tp`)."""
            nonlocal shared_out
            if not self.sequence_first:
                return run_experts(rows, counts, self.experts)
            shared = (shared_layer, flat) if shared_layer is not None else None
            outputs, idle, shared_out = run_experts_over_tp(rows, counts, self.experts, self.run.tp_group, shared)
            return outputs, idle

        rows = flat if declared.latent is None else self.fc1_latent_proj(flat)
        if declared.norms is not None:
            rows = getattr(self, EXPERT_NORMS[0])(rows)
        on_input = declared.routing.on_input
        out, counts = (self._local(rows, chosen, weights, compute, on_input) if self.run.experts is None
                       else run_dispatched(rows, chosen, weights, compute, self.run.experts, declared.experts.count,
                                           on_input))
        if declared.latent is not None:
            out = self.fc2_latent_proj(out)
        if declared.norms is not None:
            out = getattr(self, EXPERT_NORMS[1])(out)
        if shared_layer is not None:
            shared = shared_out if self.sequence_first else shared_layer(flat)
            if declared.shared_gate:
                shared = F.sigmoid(getattr(self, f"{declared.names[1]}_gate")(flat)) * shared
            out = (out.astype("float32") + shared.astype("float32")).astype(out.dtype) if declared.fp32_combine \
                else out + shared
        out = out.reshape(hidden.shape)
        learning = self.training and paddle.is_grad_enabled()
        counting = self.training and not recomputing()  # a recomputed forward routed the same tokens already
        if learning or counting:
            counts = paddle.to_tensor(counts, "int64")
            if self.parts is not None:  # this rank routed its part of each sequence: the whole sequences' counts
                counts = self.parts.all_reduce(counts)
            sequences = hidden.shape[1 if self.sequence_first else 0]
            with full_precision():
                aux = declared.routing.aux_loss(self._by_sequence(scores, hidden), counts, sequences,
                                                self._by_sequence(chosen, hidden), self.parts)
                aux = aux * declared.routing.aux_coef
            if counting:
                self.run.router_stats.record(self.layer_index, aux, counts,
                                             declared.routing.margin(scores, self.router_layer.correction))
            if learning and declared.routing.aux_coef:
                out = inject(out, aux / self.run.accumulate_steps)
        return out

    def _by_sequence(self, scores: paddle.Tensor, hidden: paddle.Tensor) -> paddle.Tensor:
        """Per-token rows (scores, chosen experts) with each sequence's tokens together (under SP a
        rank's positions are sequence-major)."""
        if not self.sequence_first:
            return scores
        seq, batch = hidden.shape[:2]
        return scores.reshape([seq, batch, -1]).transpose([1, 0, 2]).reshape([seq * batch, -1])

    def _local(self, flat, chosen, weights, compute, on_input: bool = False) -> tuple[paddle.Tensor, list[int]]:
        """Every expert on this rank, on its rows, in one pass: the (token, choice) rows sorted by
        expert once, their counts read once (one host synchronisation per layer, however many experts),
        each expert run on its slice, the weighted outputs (or outputs of weighted rows: `on_input`)
        added back to their tokens in expert order. An expert no token chose runs on one zero row with
        weight zero: its gradient is a zero."""
        choice = chosen.reshape([-1])
        order = paddle.argsort(choice, stable=True)
        token_of = order // chosen.shape[1]
        counts = np.bincount(choice.numpy(), minlength=self.declared.experts.count).tolist()
        row_weights = paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
        rows = paddle.gather(flat, token_of)
        outputs, idle = compute(rows * row_weights if on_input else rows, counts)
        weighted = outputs if on_input else outputs * row_weights
        return paddle.index_add(paddle.zeros_like(flat), token_of, 0, weighted) + idle, counts


MoE.layer = SparseMoE


def layer_moe(layer) -> MoE | None:
    """A decoder layer declaration's mixture of experts: its feed-forward part, or the one beside its
    dense MLP (Gemma 4's `moe`); None in a dense layer."""
    if isinstance(layer.feed_forward, MoE):
        return layer.feed_forward
    return getattr(layer, "moe", None)


def is_sparse(c, index: int) -> bool:
    """transformers' rule: layer `index` is MoE unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (Mixtral and OLMoE: every layer)."""
    return c.num_experts > 0 and index not in (c.mlp_only_layers or ()) and (index + 1) % c.decoder_sparse_step == 0


def moe_saved_bytes(moe: MoE, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
    """What an MoE block keeps for backward with balanced routing (each expert gets tokens x k / E):
    the router's input and fp32 probabilities (of this rank's positions under SP), each expert's
    gated-MLP activations on its tokens (every tp rank's rows under SP), the gathered rows and the
    weighted outputs (at the latent width, whose projections keep their inputs: the planner's
    model; not measured)."""
    routed, local = tokens * moe.top_k, tokens // sequence_shards(run.tp, run.sequence_parallel)
    expert = moe.experts.expert.saved_bytes(run, routed, dtype_bytes)
    width = moe.hidden if moe.latent is None else moe.latent
    saved = {"gate": local * moe.hidden * dtype_bytes + local * moe.experts.count * 4,
             "experts": sum(expert.values()) + 2 * routed * width * dtype_bytes}
    if moe.latent is not None:
        saved |= {"fc1_latent_proj": local * moe.hidden * dtype_bytes, "fc2_latent_proj": local * width * dtype_bytes}
    if moe.norms is not None:
        saved |= dict.fromkeys(EXPERT_NORMS, rms_norm_saved_bytes(local, moe.hidden, dtype_bytes, moe.norms.offset))
    if moe.shared is not None:
        shared = moe.shared.saved_bytes(run, tokens, dtype_bytes)
        saved["shared_expert"] = sum(shared.values()) + 2 * tokens * moe.hidden * dtype_bytes
    return saved
