"""The LLaMA-like decoder layer (LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma): pre-norm residual blocks
of self-attention and a gated MLP; and what a decoder layer keeps for backward under each recompute
granularity (the planner's model)."""

from __future__ import annotations

from dataclasses import dataclass

from modeling.blocks.attention import SelfAttention
from modeling.blocks.mlp import GatedMLP
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
    def declare(cls, c) -> dict[str, Part]:
        return {"self_attn": SelfAttention, "mlp": GatedMLP, "input_layernorm": c.hidden_norm(),
                "post_attention_layernorm": c.hidden_norm()}

    def _block(self, hidden):
        normed = self.input_layernorm(hidden)
        hidden = hidden + self.run.recompute("full_attn", self.self_attn, normed, training=self.training)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden):
        return self.run.recompute("full", self._block, hidden, training=self.training)

    @staticmethod
    def saved_bytes(c, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What the layer keeps for backward on a tp rank with nothing recomputed, by sublayer: equal
        byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested). The norms
        are the only activations TP leaves whole and SP splits (over tp ranks)."""
        tokens = batch * seq_len
        norm = rms_norm_saved_bytes(tokens // sequence_shards(run.tp, run.sequence_parallel), c.hidden_size,
                                    dtype_bytes, c.norm_offset, fused=run.kernels.fused_rms_norm)
        return {"input_layernorm": norm, "post_attention_layernorm": norm,
                **prefixed("self_attn", SelfAttention.saved_bytes(c, run, batch, seq_len, dtype_bytes)),
                **prefixed("mlp", GatedMLP.saved_bytes(c, run, tokens, dtype_bytes))}
