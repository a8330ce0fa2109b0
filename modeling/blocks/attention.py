"""Self-attention: q/k/v/o projections (optional biases), grouped-query heads with a `head_dim`
independent of hidden / heads, optional q/k norms per head (Qwen3) or over the whole projection (OLMoE), rotary positions (or none, for
learned positions), and the run's attention core (`modeling.attention_core`) on this tp rank's heads."""

from __future__ import annotations

from modeling.blocks.norms import FP32_BYTES, rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Norm, Part, RowLinear
from modeling.blocks.rotary import rotate
from modeling.execution import Execution
from modeling.sequence_parallel import gather_tokens


class SelfAttention(Block):
    """Reads from the config: heads, kv heads, head_dim, `qkv_bias`, `o_bias`, `qk_norm`, `rotary`
    and the output projection's name (`attention_output`: LLaMA's o_proj, GPT's out_proj)."""

    @classmethod
    def declare(cls, c) -> dict[str, Part]:
        q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        parts: dict[str, Part] = {
            "q_proj": ColumnLinear(c.hidden_size, q_width, c.qkv_bias),
            "k_proj": ColumnLinear(c.hidden_size, kv_width, c.qkv_bias),
            "v_proj": ColumnLinear(c.hidden_size, kv_width, c.qkv_bias),
            c.attention_output: RowLinear(q_width, c.hidden_size, c.o_bias),
        }
        if c.qk_norm == "head":
            parts |= {"q_norm": Norm(c.head_dim, c.rms_norm_eps, per_head=True),
                      "k_norm": Norm(c.head_dim, c.rms_norm_eps, per_head=True)}
        elif c.qk_norm == "projection":
            parts |= {"q_norm": Norm(q_width, c.rms_norm_eps, split=True),
                      "k_norm": Norm(kv_width, c.rms_norm_eps, split=True)}
        return parts

    @classmethod
    def tp_fields(cls, config) -> tuple[str, ...]:
        return ("num_attention_heads", "num_key_value_heads")

    def __init__(self, config, run: Execution):
        super().__init__(config, run)
        self.local_heads = config.num_attention_heads // run.tp
        self.local_kv_heads = config.num_key_value_heads // run.tp

    def forward(self, hidden):
        c, run = self.config, self.run
        hidden = gather_tokens(hidden, run)
        seq_first = run.sequence_first
        lead = hidden.shape[:2]  # [batch, seq], or [seq, batch] under sequence parallelism
        q, k = self.q_proj(hidden), self.k_proj(hidden)
        if c.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(lead + [self.local_heads, c.head_dim])
        k = k.reshape(lead + [self.local_kv_heads, c.head_dim])
        v = self.v_proj(hidden).reshape(lead + [self.local_kv_heads, c.head_dim])
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rotary:
            q, k = rotate(q, k, c, lead[0] if seq_first else lead[1], seq_first, run.kernels.fused_rope, run.cp)
        out = run.recompute("core_attn", lambda *qkv: run.attention(*qkv, seq_first), q, k, v, training=self.training)
        return getattr(self, c.attention_output)(out)

    @staticmethod
    def core_bytes(c, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int, int]:
        """(what the core keeps, its inputs q, k and v, its output) in bytes on this tp rank."""
        heads, kv_heads = c.num_attention_heads // run.tp, c.num_key_value_heads // run.tp
        kept = run.attention.saved_bytes(batch, seq_len, heads, kv_heads, c.head_dim, dtype_bytes, run.sequence_first)
        return (kept, batch * seq_len * (heads + 2 * kv_heads) * c.head_dim * dtype_bytes,
                batch * seq_len * heads * c.head_dim * dtype_bytes)

    @staticmethod
    def saved_bytes(c, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward, by its sublayers' names ("" for its own code): q, k and v
        share one saved input, full-size with or without SP; the core keeps what its own model says,
        and the output projection its input unless the core already keeps that tensor. The rotary
        tables are constants every layer shares in fp32, not activations; in a narrower compute dtype
        each layer keeps its own rounded copy of cos and sin."""
        tokens, heads = batch * seq_len, c.num_attention_heads // run.tp
        kept, _, output = SelfAttention.core_bytes(c, run, batch, seq_len, dtype_bytes)
        rotary = 2 * seq_len * c.head_dim * dtype_bytes if c.rotary and dtype_bytes < FP32_BYTES else 0
        saved = {"q_proj": tokens * c.hidden_size * dtype_bytes, "": kept + rotary,
                 c.attention_output: 0 if run.attention.keeps_output(run.sequence_first) else output}
        kv_heads = c.num_key_value_heads // run.tp
        if c.qk_norm == "head":
            saved |= {"q_norm": rms_norm_saved_bytes(tokens, c.head_dim, dtype_bytes, False, heads),
                      "k_norm": rms_norm_saved_bytes(tokens, c.head_dim, dtype_bytes, False, kv_heads)}
        elif c.qk_norm == "projection":
            saved |= {"q_norm": rms_norm_saved_bytes(tokens, heads * c.head_dim, dtype_bytes, False),
                      "k_norm": rms_norm_saved_bytes(tokens, kv_heads * c.head_dim, dtype_bytes, False)}
        return saved
