"""Decoder layers that hand tensors to later layers beside the hidden states: Gemma 4's per-layer
embeddings and keys and values shared between layers, GLM-5.2's shared sparse-attention selections.

- **Per-layer embeddings** (Gemma 4 E2B/E4B, `hidden_size_per_layer_input` d > 0; `PerLayerEmbeddings`):
  the first stage looks every token up in a second embedding [vocab, layers x d] (times sqrt(d)),
  projects the scaled token embeddings to layers x d (times hidden^-1/2) and normalises each layer's d
  entries, and gives layer i the mean of its two slices (their sum times 2^-1/2). Layer i gates its
  output with it: h + norm(projection(act(gate(h)) x input_i)). The slices travel as one tensor per
  layer beside the hidden states, and each layer takes its own off, so what crosses a pipeline stage
  shrinks along the pipeline. Everything here is token-local and small (d is 256 for a hidden of
  1536-2560), so every tp rank computes it whole on the positions it holds (under sequence
  parallelism its own, its gradient then a part summed over tp): no collective of its own.
- **Shared keys and values** (`num_kv_shared_layers`): the last layers attend with the keys and values
  the last earlier layer of their attention type computed (normalised and rotated); they have no
  projections of their own. The storing layer hands them on, they travel beside the hidden states to
  the last layer that reads them (across pipeline stages too: fleet's p2p sends every tensor of the
  tuple and returns each one's gradient), and every reader's gradient flows back into the storing
  layer's projections.
- **Shared selections** (GLM-5.2's `indexer_types` "shared"): a layer without an indexer attends to
  the keys the last layer before it with one selected (`latent_attention.handed_on`: fp32 indices,
  -1 where unseen; no gradient).
- **`layer_scalar`**: a stored constant the layer's output is multiplied by.
- **Experts beside the MLP** (26B-A4B, `moe`): the hidden states as they come are routed to experts
  whose sum is normalised and added to the normalised dense MLP's output, before the layer's
  post-feed-forward norm (`blocks/moe.py`, with `EXPERT_NORMS` and Gemma 4's `ScaledRouter`).

What travels is named per layer (`CarryingDecoder.carried_in` / `carried_out`, from the config's
`carried(index)`); a tensor leaves the tuple after its last reader, so the final norm and the head
see the hidden states alone. The set changes along the pipeline, which 1F1B's p2p allows (each
stage boundary has its shapes) and the interleaved schedules' single cached shape does not: the run
plan refuses vpp and DualPipeV for such a model. A stage's last layer hands on copies
(`documents.handed_across`): fleet frees what a stage sent, and its backward may still read a key it
reused or a per-layer input it passed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import paddle
from paddle import nn
from paddle.autograd import PyLayer

from modeling.blocks.decoder import Decoder, DecoderLayer, prefixed
from modeling.blocks.embedding import scaled
from modeling.blocks.mlp import ACTIVATIONS
from modeling.blocks.moe import MoE
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Buffer, Norm, Part, VocabEmbedding, WholeLinear
from modeling.documents import handed_across, state, unpack
from modeling.execution import Execution
from modeling.sequence_parallel import scatter_sequence, sequence_shards

PER_LAYER_NAMES = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
MOE_OUTPUT_NORM = "post_feedforward_layernorm_1"  # the dense MLP's output's, beside experts (the experts': moe.py)


def per_layer_input(index: int) -> str:
    """The carried name of layer `index`'s per-layer input."""
    return f"per_layer_input.{index}"


def shared_kv(layer_type: str) -> tuple[str, str]:
    """The carried names of the keys and values the layers of `layer_type` share."""
    return f"{layer_type}.keys", f"{layer_type}.values"


@dataclass(frozen=True)
class PerLayerEmbeddings:
    """The first stage's part of per-layer embeddings: `vocab` x (`layers` x `dim`) token entries, the
    projection of the `hidden`-wide embeddings, and the norm over each layer's `dim` entries."""

    vocab: int
    hidden: int
    layers: int
    dim: int
    eps: float

    def parts(self) -> dict[str, Part]:
        return {"embed_tokens_per_layer": VocabEmbedding(self.vocab, self.layers * self.dim, "vocab_size_per_layer_input"),
                "per_layer_model_projection": WholeLinear(self.hidden, self.layers * self.dim),
                "per_layer_projection_norm": Norm(self.dim, self.eps)}

    def inputs(self, run: Execution, built: dict[str, nn.Layer], input_ids, hidden) -> tuple[paddle.Tensor, ...]:
        """Each layer's input, in layer order, at the positions this rank holds: `hidden` is the first
        layer's input (the scaled embeddings, scattered under sequence parallelism)."""
        tokens = scaled(built["embed_tokens_per_layer"](input_ids), math.sqrt(self.dim))
        tokens = scatter_sequence(tokens, run)
        projected = paddle.scale(built["per_layer_model_projection"](hidden), self.hidden ** -0.5)
        lead = projected.shape[:2]
        projected = built["per_layer_projection_norm"](projected.reshape(lead + [self.layers, self.dim]))
        combined = paddle.scale(projected + tokens.reshape(lead + [self.layers, self.dim]), 2 ** -0.5)
        # sent between pipeline stages as they are, where p2p takes contiguous tensors
        return tuple(each.contiguous() for each in paddle.unbind(combined, axis=2))


def _contiguous_gradient(tensor: paddle.Tensor) -> paddle.Tensor:
    """`tensor`, its gradient made contiguous: the gradient of a tensor received from the previous
    pipeline stage is sent back by p2p, which takes contiguous tensors only, and an attention core's
    backward may give its keys' and values' as strided views."""
    if not tensor.stop_gradient:
        tensor.register_hook(lambda grad: grad.contiguous())
    return tensor


class _TimesConstant(PyLayer):
    """x times a stored scalar tensor (`layer_scalar`), keeping only the scalar for backward (a product
    would keep x, the whole hidden states)."""

    @staticmethod
    def forward(ctx, x, scalar):
        ctx.save_for_backward(scalar)
        return x * scalar.astype(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (scalar,) = ctx.saved_tensor()
        return dy * scalar.astype(dy.dtype), None


@dataclass(frozen=True)
class CarryingDecoder(Decoder):
    """A `Decoder` with a per-layer input `per_layer_dim` wide (None: none), gated with the activation
    `per_layer_activation`, a stored `layer_scalar` (`scalar`), the names of what travels beside the
    hidden states into it and out of it, what of that its token mixer takes (`mixer_takes`: the keys
    and values, or the sparse-attention selection, it reuses) and what it hands on (`mixer_gives`: its
    own, which it then returns beside its output), and experts beside its dense MLP (`moe`, whose
    output and the MLP's, normalised by `MOE_OUTPUT_NORM`, are summed: Gemma 4's)."""

    per_layer_dim: int | None = None
    per_layer_activation: str = "gelu_pytorch_tanh"
    scalar: bool = False
    carried_in: tuple[str, ...] = ()
    carried_out: tuple[str, ...] = ()
    mixer_takes: tuple[str, ...] = ()
    mixer_gives: tuple[str, ...] = ()
    moe: MoE | None = None

    def parts(self) -> dict[str, Part]:
        parts = super().parts()
        if self.moe is not None:
            parts |= {"moe": self.moe, MOE_OUTPUT_NORM: self.norm}
        if self.per_layer_dim:
            hidden, dim = self.norm.dim, self.per_layer_dim
            gate, projection, norm = PER_LAYER_NAMES
            parts |= {gate: WholeLinear(hidden, dim), projection: WholeLinear(dim, hidden), norm: self.norm}
        return parts | ({"layer_scalar": Buffer((1,), 1.0)} if self.scalar else {})

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """The decoder's, and the per-layer input's: the gate's input, the activation's input and the
        product's two factors (the layer's own, d wide each), the projection's input, its norm's; the
        scalar is a buffer."""
        saved = super().saved_bytes(run, batch, seq_len, dtype_bytes)
        local = batch * seq_len // sequence_shards(run.tp, run.sequence_parallel)
        if self.moe is not None:
            saved |= prefixed("moe", self.moe.saved_bytes(run, batch * seq_len, dtype_bytes))
            saved[MOE_OUTPUT_NORM] = rms_norm_saved_bytes(local, self.norm.dim, dtype_bytes, self.norm.offset,
                                                          fused=run.kernels.fused_rms_norm)
        if not self.per_layer_dim:
            return saved
        gate, projection, norm = PER_LAYER_NAMES
        narrow = local * self.per_layer_dim * dtype_bytes
        return saved | {gate: local * self.norm.dim * dtype_bytes, "": 3 * narrow, projection: narrow,
                        norm: rms_norm_saved_bytes(local, self.norm.dim, dtype_bytes, self.norm.offset,
                                                   fused=run.kernels.fused_rms_norm)}


class CarryingDecoderLayer(DecoderLayer):
    def forward(self, layer_state):
        """Takes its own per-layer input and what its token mixer reuses (keys and values, a selection)
        off what travels, puts what its mixer hands on on, and hands on what layers after it read."""
        declared = self.declared
        hidden, positions, carried = unpack(layer_state)
        named = dict(zip(declared.carried_in, carried))
        taken = ([per_layer_input(declared.index)] if declared.per_layer_dim else []) + list(declared.mixer_takes)
        inputs = [hidden] + [_contiguous_gradient(named[name]) for name in taken]
        out = self.run.recompute("full", lambda *xs: self._carrying_block(positions, *xs), *inputs,
                                 training=self.training)
        if declared.mixer_gives:
            out, *given = out
            named |= dict(zip(declared.mixer_gives, given))
        out = state(out, positions, tuple(named[name] for name in declared.carried_out))
        return handed_across(out) if self.ends_stage else out

    def _carrying_block(self, positions, hidden, *rest):
        declared, norms = self.declared, self.declared.norms
        per_layer = rest[0] if declared.per_layer_dim else None
        taken = rest[1:] if declared.per_layer_dim else rest
        mixer = getattr(self, declared.attention_name)
        normed = getattr(self, norms.before_attention)(hidden) if norms.before_attention else hidden
        out = self.run.recompute("full_attn", lambda x, *took: mixer(x, positions, took or None), normed, *taken,
                                 training=self.training)
        out, *given = out if declared.mixer_gives else (out,)
        hidden = hidden + (getattr(self, norms.after_attention)(out) if norms.after_attention else out)
        if declared.moe is None:
            hidden = self._branch(hidden, norms.before_feed_forward, getattr(self, declared.feed_forward_name),
                                  norms.after_feed_forward)
        else:  # the experts beside the MLP read the hidden states as they come
            out = getattr(self, declared.feed_forward_name)(getattr(self, norms.before_feed_forward)(hidden))
            out = getattr(self, MOE_OUTPUT_NORM)(out) + self.moe(hidden)
            hidden = hidden + getattr(self, norms.after_feed_forward)(out)
        if per_layer is not None:
            gate, projection, norm = (getattr(self, name) for name in PER_LAYER_NAMES)
            gated = ACTIVATIONS[declared.per_layer_activation](gate(hidden)) * per_layer
            hidden = hidden + norm(projection(gated))
        if declared.scalar:
            hidden = _TimesConstant.apply(hidden, self.layer_scalar)
        return (hidden, *given) if given else hidden


CarryingDecoder.layer = CarryingDecoderLayer
