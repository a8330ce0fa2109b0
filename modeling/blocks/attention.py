"""Self-attention: q/k/v/o projections (optional biases), grouped-query heads with a `head_dim`
independent of hidden / heads, optional per-head q/k norms (Qwen3), rotary positions (or none, for
learned positions), and causal scaled dot-product attention on this tp rank's heads."""

from __future__ import annotations

import functools
import math

import paddle
import paddle.nn.functional as F

from modeling.autocast import full_precision
from modeling.blocks.norms import FP32_BYTES, rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Norm, Part, RowLinear
from modeling.blocks.rotary import apply_rotary, rotary_tables
from modeling.sequence_parallel import enabled as sequence_first, gather_tokens
from modeling.tp_layers import tp_degree


@functools.lru_cache(maxsize=8)
def causal_mask(seq_len: int) -> paddle.Tensor:
    """[1, 1, seq, seq], True where a query may attend (built once per length: it is a constant)."""
    return paddle.tril(paddle.ones([seq_len, seq_len], dtype="bool"))[None, None]


def causal_attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool = False) -> paddle.Tensor:
    """q, k, v [batch, seq, heads, head_dim] -> [batch, seq, heads * head_dim]; softmax in fp32.
    With `seq_first` (sequence parallelism) both are [seq, batch, ...]: the one transpose to
    [batch, heads, seq, head_dim] each side absorbs the layout, so it costs no extra copy."""
    if seq_first:
        seq, batch, heads, head_dim = q.shape
        q, k, v = (t.transpose([1, 2, 0, 3]) for t in (q, k, v))
    else:
        batch, seq, heads, head_dim = q.shape
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = paddle.matmul(q * (1 / math.sqrt(head_dim)), k.transpose([0, 1, 3, 2]))
    # masked scores become the dtype's minimum, as adding an additive mask gives, at half the cost
    scores = paddle.where(causal_mask(seq), scores, paddle.full([], paddle.finfo(scores.dtype).min, scores.dtype))
    with full_precision():  # O2 would run the softmax in bf16 (as PaddleNLP's LLaMA avoids)
        probs = F.softmax(scores.astype("float32"), axis=-1).astype(v.dtype)
    out = paddle.matmul(probs, v)  # [batch, heads, seq, head_dim]
    if seq_first:
        return out.transpose([2, 0, 1, 3]).reshape([seq, batch, heads * head_dim])
    return out.transpose([0, 2, 1, 3]).reshape([batch, seq, heads * head_dim])


def causal_attention_saved_bytes(batch: int, seq_len: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What `causal_attention` keeps for backward on `heads` local heads: the scaled q, k and v,
    the fp32 probabilities and the boolean causal mask."""
    scores = batch * heads * seq_len * seq_len
    return 3 * batch * seq_len * heads * head_dim * dtype_bytes + scores * (FP32_BYTES + 1)


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
        if c.qk_norm:
            parts |= {"q_norm": Norm(c.head_dim, c.rms_norm_eps, per_head=True),
                      "k_norm": Norm(c.head_dim, c.rms_norm_eps, per_head=True)}
        return parts

    @classmethod
    def tp_fields(cls, config) -> tuple[str, ...]:
        return ("num_attention_heads", "num_key_value_heads")

    def __init__(self, config):
        super().__init__(config)
        tp = tp_degree(config)
        self.local_heads = config.num_attention_heads // tp
        self.local_kv_heads = config.num_key_value_heads // tp

    def forward(self, hidden):
        c = self.config
        hidden = gather_tokens(hidden, c)
        seq_first = sequence_first(c)
        lead = hidden.shape[:2]  # [batch, seq], or [seq, batch] under sequence parallelism
        q = self.q_proj(hidden).reshape(lead + [self.local_heads, c.head_dim])
        k = self.k_proj(hidden).reshape(lead + [self.local_kv_heads, c.head_dim])
        v = self.v_proj(hidden).reshape(lead + [self.local_kv_heads, c.head_dim])
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rotary:
            cos, sin = rotary_tables(c, lead[0] if seq_first else lead[1], seq_first)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.local_heads // self.local_kv_heads
        if groups > 1:  # every query head of a group reads its kv head
            k = k.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape(lead + [self.local_heads, c.head_dim])
            v = v.unsqueeze(-2).tile([1, 1, 1, groups, 1]).reshape(lead + [self.local_heads, c.head_dim])
        return getattr(self, c.attention_output)(causal_attention(q, k, v, seq_first))

    @staticmethod
    def saved_bytes(c, batch: int, seq_len: int, tp: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward, by its sublayers' names ("" for its own code): q, k and v
        share one saved input, full-size with or without SP; k and v reach the core repeated to every
        head; the rotary tables (cos, sin) are counted here although every layer shares them."""
        tokens, heads, kv_heads = batch * seq_len, c.num_attention_heads // tp, c.num_key_value_heads // tp
        core = causal_attention_saved_bytes(batch, seq_len, heads, c.head_dim, dtype_bytes)
        rotary = 2 * seq_len * c.head_dim * FP32_BYTES if c.rotary else 0
        saved = {"q_proj": tokens * c.hidden_size * dtype_bytes, "": core + rotary,
                 c.attention_output: tokens * heads * c.head_dim * dtype_bytes}
        if c.qk_norm:
            saved |= {"q_norm": rms_norm_saved_bytes(tokens, c.head_dim, dtype_bytes, False, heads),
                      "k_norm": rms_norm_saved_bytes(tokens, c.head_dim, dtype_bytes, False, kv_heads)}
        return saved
