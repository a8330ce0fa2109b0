"""The LLaMA-like decoder layer (LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma): pre-norm residual blocks
of self-attention and a gated MLP; and what a decoder layer keeps for backward under each recompute
granularity (the planner's model)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from modeling.blocks.attention import SelfAttention
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.moe import SparseMoE, is_sparse, moe_saved_bytes
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, Part
from modeling.execution import Execution
from modeling.sequence_parallel import sequence_shards


def prefixed(prefix: str, saved: dict[str, int]) -> dict[str, int]:
    """A sublayer's `saved_bytes` under its name in the layer ("" stays the sublayer's own)."""
    return {f"{prefix}.{key}".rstrip("."): value for key, value in saved.items()}


@dataclass(frozen=True)
class LayerActivations:
    """A decoder layer's activation bytes on a rank: `kept` from its forward to its backward, and
    `rebuilt` at once while its backward recomputes (0 without recompute)."""

    kept: int
    rebuilt: int = 0


def layer_activations(layer: type[Block], c, run: Execution, batch: int, seq_len: int,
                      dtype_bytes: int) -> LayerActivations:
    """`layer.saved_bytes` (what it keeps with nothing recomputed) under the run's granularity:
    full keeps the layer's input; full_attn keeps the attention's normed input instead of what
    the attention keeps; core_attn keeps the core's q, k and v instead of what the core keeps, and
    the output projection then keeps the core's (recomputed, so new) output."""
    saved = layer.saved_bytes(c, run, batch, seq_len, dtype_bytes)
    total, granularity = sum(saved.values()), run.recompute.granularity
    hidden = batch * seq_len // sequence_shards(run.tp, run.sequence_parallel) * c.hidden_size * dtype_bytes
    if granularity is None:
        return LayerActivations(total)
    if granularity == "full":
        return LayerActivations(hidden, total)
    if granularity == "full_attn":
        attention = sum(value for key, value in saved.items() if key.split(".")[0] == "self_attn")
        return LayerActivations(total - attention + hidden, attention)
    kept, inputs, output = SelfAttention.core_bytes(c, run, batch, seq_len, dtype_bytes)
    new_output = output if run.attention.keeps_output(run.sequence_first) else 0
    return LayerActivations(total - kept + inputs + new_output, kept)


class DecoderLayer(Block):
    @classmethod
    def feed_forward(cls, c) -> tuple[str, Part]:
        """The feed-forward part's name and part."""
        return "mlp", GatedMLP

    @classmethod
    def declare(cls, c) -> dict[str, Part]:
        name, part = cls.feed_forward(c)
        return {"self_attn": SelfAttention, name: part, "input_layernorm": c.hidden_norm(),
                "post_attention_layernorm": c.hidden_norm()}

    def _block(self, hidden):
        normed = self.input_layernorm(hidden)
        hidden = hidden + self.run.recompute("full_attn", self.self_attn, normed, training=self.training)
        return hidden + getattr(self, self.feed_forward(self.config)[0])(self.post_attention_layernorm(hidden))

    def forward(self, hidden):
        return self.run.recompute("full", self._block, hidden, training=self.training)

    @classmethod
    def saved_bytes(cls, c, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What the layer keeps for backward on a tp rank with nothing recomputed, by sublayer: equal
        byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested). The norms
        are the only activations TP leaves whole and SP splits (over tp ranks)."""
        tokens = batch * seq_len
        norm = rms_norm_saved_bytes(tokens // sequence_shards(run.tp, run.sequence_parallel), c.hidden_size,
                                    dtype_bytes, c.norm_offset, fused=run.kernels.fused_rms_norm)
        return {"input_layernorm": norm, "post_attention_layernorm": norm,
                **prefixed("self_attn", SelfAttention.saved_bytes(c, run, batch, seq_len, dtype_bytes)),
                **prefixed(cls.feed_forward(c)[0], cls.feed_forward_bytes(c, run, tokens, dtype_bytes))}

    @classmethod
    def feed_forward_bytes(cls, c, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        return GatedMLP.saved_bytes(c, run, tokens, dtype_bytes)


class SparseDecoderLayer(DecoderLayer):
    """A mixture-of-experts family's decoder layer: the MoE block (named `moe_block`: "mlp", Mixtral's
    "block_sparse_moe") where `is_sparse` says so, else the dense layer; `index` is its place."""

    index = 0

    @classmethod
    def for_layer(cls, config, index: int) -> type[Block]:
        if not is_sparse(config, index):
            return DecoderLayer
        return _placed(cls, index)

    @classmethod
    def kind(cls) -> type[Block]:
        return SparseDecoderLayer

    @classmethod
    def feed_forward(cls, c) -> tuple[str, Part]:
        return c.moe_block, SparseMoE

    @classmethod
    def feed_forward_bytes(cls, c, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        return moe_saved_bytes(c, run, tokens, dtype_bytes)

    def __init__(self, config, run: Execution):
        super().__init__(config, run)
        getattr(self, config.moe_block).layer_index = self.index


@lru_cache(maxsize=None)
def _placed(layer: type[SparseDecoderLayer], index: int) -> type[SparseDecoderLayer]:
    """`layer` built for place `index` (its name keeps "DecoderLayer": the pipeline's segment pattern)."""
    return type(f"{layer.__name__}{index}", (layer,), {"index": index, "__module__": __name__})
