"""The decoder layer every family is built from, declared per layer (`Decoder`): its token mixer
(attention, or a recurrent mixer), its feed-forward part (a gated MLP, a plain MLP, or a mixture of
experts), each under the family's name for it and either absent in a layer that has only the other
(Nemotron-H's), where its norms sit around them (`NormPlacement`: LLaMA's pre-norms, Gemma 2/3's four, OLMo-2's
post-norms only) and what multiplies the residual branches (Granite); and what a decoder layer keeps
for backward under each recompute granularity (the planner's model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.blocks.norms import layer_norm_saved_bytes, rms_norm_saved_bytes
from modeling.blocks.parts import Block, Declared, Norm, Part
from modeling.documents import handed_across, unpack, with_hidden
from modeling.execution import Execution
from modeling.sequence_parallel import sequence_shards


def prefixed(prefix: str, saved: dict[str, int]) -> dict[str, int]:
    """A sublayer's `saved_bytes` under its name in the layer ("" stays the sublayer's own)."""
    return {f"{prefix}.{key}".rstrip("."): value for key, value in saved.items()}


def token_mixers(layer) -> list:
    """A decoder layer declaration's token mixers, each on its own (the two of Falcon-H1's parallel pair,
    none in a layer with only a feed-forward part): what the registry's per-mixer checks read."""
    mixer = layer.attention
    if mixer is None:
        return []
    return list(mixer.token_mixers()) if hasattr(mixer, "token_mixers") else [mixer]


@dataclass(frozen=True)
class NormPlacement:
    """The names of the norms around a layer's two branches (None: no norm there): before and after
    the attention, before and after the feed-forward part."""

    before_attention: str | None = "input_layernorm"
    after_attention: str | None = None
    before_feed_forward: str | None = "post_attention_layernorm"
    after_feed_forward: str | None = None

    def names(self) -> list[str]:
        return [name for name in (self.before_attention, self.after_attention, self.before_feed_forward,
                                  self.after_feed_forward) if name]


PRE_NORMS = NormPlacement()  # LLaMA and most families
SANDWICH_NORMS = NormPlacement("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                               "post_feedforward_layernorm")  # Gemma 2 and 3
POST_NORMS = NormPlacement(None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo-2


@dataclass(frozen=True)
class LayerActivations:
    """A decoder layer's activation bytes on a rank: `kept` from its forward to its backward, and
    `rebuilt` at once while its backward recomputes (0 without recompute)."""

    kept: int
    rebuilt: int = 0


@dataclass(frozen=True)
class Decoder(Declared):
    """Decoder layer `index`: x + m * post(attention(pre(x))), then the same around the feed-forward
    part named `feed_forward_name`, with m the `residual_multiplier` (Granite; 1 elsewhere). A layer
    without a token mixer or without a feed-forward part (None) has only the other branch, and only
    the norms `norms` names around it."""

    index: int
    attention: Part | None
    feed_forward: Part | None
    norm: Norm
    feed_forward_name: str = "mlp"
    attention_name: str = "self_attn"
    norms: NormPlacement = field(default=PRE_NORMS)
    residual_multiplier: float = 1.0

    def parts(self) -> dict[str, Part]:
        branches = {self.attention_name: self.attention, self.feed_forward_name: self.feed_forward}
        return {**{name: part for name, part in branches.items() if part is not None},
                **dict.fromkeys(self.norms.names(), self.norm)}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What the layer keeps for backward on a tp rank with nothing recomputed, by sublayer: equal
        byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested). The norms
        are the only activations TP leaves whole and SP splits (over tp ranks); a norm after a branch
        normalises its output, so it keeps what a norm before one keeps."""
        tokens = batch * seq_len
        local = tokens // sequence_shards(run.tp, run.sequence_parallel)
        if self.norm.layer_norm:
            norm = layer_norm_saved_bytes(local, self.norm.dim, dtype_bytes)
        else:
            norm = rms_norm_saved_bytes(local, self.norm.dim, dtype_bytes, self.norm.offset,
                                        fused=run.kernels.fused_rms_norm)
        saved = dict.fromkeys(self.norms.names(), norm)
        if self.attention is not None:
            saved |= prefixed(self.attention_name, self.attention.saved_bytes(run, batch, seq_len, dtype_bytes))
        if self.feed_forward is not None:
            saved |= prefixed(self.feed_forward_name, self.feed_forward.saved_bytes(run, tokens, dtype_bytes))
        return saved

    def activations(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> LayerActivations:
        return layer_activations(self, run, batch, seq_len, dtype_bytes)


def layer_activations(layer, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> LayerActivations:
    """A decoder layer declaration's `saved_bytes` (what it keeps with nothing recomputed) under the
    run's granularity: full keeps the layer's input; full_attn keeps the attention's input instead of
    what the attention keeps; core_attn keeps the core's q, k and v instead of what the core keeps,
    and the output projection then keeps the core's (recomputed, so new) output. A recurrent mixer
    has no attention core (its rule keeps only its inputs already): core_attn keeps all of it."""
    saved = layer.saved_bytes(run, batch, seq_len, dtype_bytes)
    total, granularity = sum(saved.values()), run.recompute.granularity
    hidden = batch * seq_len // sequence_shards(run.tp, run.sequence_parallel) * layer.norm.dim * dtype_bytes
    if granularity is None:
        return LayerActivations(total)
    if granularity == "full":
        return LayerActivations(hidden, total)
    if granularity == "full_attn":
        if layer.attention is None:
            return LayerActivations(total)
        attention = sum(value for key, value in saved.items() if key.split(".")[0] == layer.attention_name)
        return LayerActivations(total - attention + hidden, attention)
    if layer.attention is None or layer.attention.recurrent:  # no attention core to recompute
        return LayerActivations(total)
    kept, inputs, output = layer.attention.core_bytes(run, batch, seq_len, dtype_bytes)
    new_output = output if layer.attention.core(run).keeps_output(run.sequence_first) else 0
    return LayerActivations(total - kept + inputs + new_output, kept)


class DecoderLayer(Block):
    """Built from a `Decoder` declaration (its class name keeps "DecoderLayer": fleet's pipeline
    segment pattern finds decoder layers by it). `ends_stage`: the last decoder layer of its pipeline
    stage or chunk (`pipeline.CausalLMPipe` sets it), which hands on copies of what travels beside the
    hidden states (`documents.handed_across`)."""

    ends_stage = False

    def __init__(self, config, run: Execution, declared: Decoder):
        super().__init__(config, run, declared)
        self.index = declared.index

    def _branch(self, hidden, before: str | None, branch, after: str | None, scope: str | None = None):
        normed = getattr(self, before)(hidden) if before else hidden
        out = self.run.recompute(scope, branch, normed, training=self.training) if scope else branch(normed)
        out = getattr(self, after)(out) if after else out
        multiplier = self.declared.residual_multiplier
        return hidden + (out if multiplier == 1.0 else out * multiplier)

    def _block(self, hidden, positions=None):
        declared, norms = self.declared, self.declared.norms
        if declared.attention is not None:
            attention = getattr(self, declared.attention_name)
            hidden = self._branch(hidden, norms.before_attention, lambda normed: attention(normed, positions),
                                  norms.after_attention, "full_attn")
        if declared.feed_forward is None:
            return hidden
        return self._branch(hidden, norms.before_feed_forward, getattr(self, declared.feed_forward_name),
                            norms.after_feed_forward)

    def forward(self, layer_state):
        """`layer_state`: the hidden states, or a tuple with the document positions under per-document
        attention and what multi-token prediction carries (`documents.state`); given back in the same
        form with new hidden states."""
        hidden, positions, _ = unpack(layer_state)
        hidden = self.run.recompute("full", lambda x: self._block(x, positions), hidden, training=self.training)
        out = with_hidden(layer_state, hidden)
        return handed_across(out) if self.ends_stage else out


Decoder.layer = DecoderLayer
