"""The LLaMA-like decoder layer (LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma): pre-norm residual blocks
of self-attention and a gated MLP."""

from __future__ import annotations

from modeling.blocks.attention import SelfAttention
from modeling.blocks.mlp import GatedMLP
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, Part
from modeling.recompute import maybe_recompute
from modeling.sequence_parallel import sequence_shards


class DecoderLayer(Block):
    @classmethod
    def declare(cls, c) -> dict[str, Part]:
        return {"self_attn": SelfAttention, "mlp": GatedMLP, "input_layernorm": c.hidden_norm(),
                "post_attention_layernorm": c.hidden_norm()}

    def _block(self, hidden):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden):
        return maybe_recompute(self._block, hidden, self.config.recompute, self.training)

    @staticmethod
    def saved_bytes(c, batch: int, seq_len: int, tp: int, sequence_parallel: bool, dtype_bytes: int) -> dict[str, int]:
        """What the layer keeps for backward on a tp rank, by sublayer: the planner's activation
        model, equal byte for byte to what `paddle_pp.training.activations` measures in fp32 (tested).
        The norms are the only activations TP leaves whole and SP splits (over tp ranks)."""
        tokens = batch * seq_len
        norm = rms_norm_saved_bytes(tokens // sequence_shards(tp, sequence_parallel), c.hidden_size, dtype_bytes,
                                    c.norm_offset)
        attention = SelfAttention.saved_bytes(c, batch, seq_len, tp, dtype_bytes)
        mlp = GatedMLP.saved_bytes(c, tokens, tp, dtype_bytes)
        return {"input_layernorm": norm, "post_attention_layernorm": norm,
                **{f"self_attn.{k}".rstrip("."): v for k, v in attention.items()},
                **{f"mlp.{k}".rstrip("."): v for k, v in mlp.items()}}
