"""The attention core: causal softmax(q k^T / sqrt(head_dim)) v on one rank's heads, chosen once per
run (torchtitan's inner attention) and handed to every attention block in the model's `Execution`.

The three cores compute the same function and differ in what they keep for backward, which each
states beside its code (`saved_bytes`: the planner's model, exact against the measurement on CPU):
- `dense`: the fp32 probabilities, seq^2 per head (the reference; PaddleNLP's path without flash);
- `blockwise`: q, k, v, the output and an fp32 log-sum-exp per query row, linear in seq (any device);
- `flash`: Paddle's FlashAttention-2 kernel (GPU, bf16/fp16), linear in seq.
Every core takes k and v with their own (kv) heads: grouped-query attention never repeats them.

`choose_core`: `--use_flash_attention` (the default) takes flash where Paddle's kernel applies and
blockwise elsewhere; `--no-use_flash_attention` takes dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from modeling.attention_core.blockwise import DEFAULT_BLOCK, blockwise_causal_attention
from modeling.attention_core.dense import dense_causal_attention
from modeling.attention_core.flash import LSE_ROW_MULTIPLE, flash_causal_attention, flash_refusal

FP32_BYTES, SEED_OFFSET_BYTES = 4, 16


def _qkv_bytes(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return batch * seq_len * (heads + 2 * kv_heads) * head_dim * dtype_bytes


@dataclass(frozen=True)
class AttentionCore:
    """A causal attention function over q [.., heads, head_dim] and k, v [.., kv_heads, head_dim]
    ([batch, seq, ...], or [seq, batch, ...] with `seq_first`), returning [.., heads x head_dim]."""

    name = "core"

    def __call__(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool) -> paddle.Tensor:
        raise NotImplementedError

    def saved_bytes(self, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                    seq_first: bool) -> int:
        """What one call keeps for backward on `heads` local heads."""
        raise NotImplementedError

    def keeps_output(self, seq_first: bool) -> bool:
        """Whether the tensor it returns is among what it keeps (then the output projection, which
        keeps its input, adds nothing)."""
        return False


@dataclass(frozen=True)
class DenseCore(AttentionCore):
    name = "dense"

    def __call__(self, q, k, v, seq_first):
        return dense_causal_attention(q, k, v, seq_first)

    def saved_bytes(self, batch, seq_len, heads, kv_heads, head_dim, dtype_bytes, seq_first) -> int:
        """The scaled q, k and v, and per score: the fp32 probabilities, their copy in the compute dtype
        (none in fp32) and the causal mask broadcast to the scores (a bool)."""
        per_score = FP32_BYTES + 1 + (dtype_bytes if dtype_bytes < FP32_BYTES else 0)
        return (_qkv_bytes(batch, seq_len, heads, kv_heads, head_dim, dtype_bytes)
                + batch * heads * seq_len * seq_len * per_score)


@dataclass(frozen=True)
class BlockwiseCore(AttentionCore):
    name = "blockwise"
    block: int = DEFAULT_BLOCK

    def __call__(self, q, k, v, seq_first):
        return blockwise_causal_attention(q, k, v, seq_first, self.block)

    def saved_bytes(self, batch, seq_len, heads, kv_heads, head_dim, dtype_bytes, seq_first) -> int:
        """q, k and v as given, the output and an fp32 log-sum-exp per query row and head."""
        return (_qkv_bytes(batch, seq_len, heads, kv_heads, head_dim, dtype_bytes)
                + batch * seq_len * heads * (head_dim * dtype_bytes + FP32_BYTES))

    def keeps_output(self, seq_first: bool) -> bool:
        return True


@dataclass(frozen=True)
class FlashCore(AttentionCore):
    name = "flash"

    def __call__(self, q, k, v, seq_first):
        return flash_causal_attention(q, k, v, seq_first)

    def saved_bytes(self, batch, seq_len, heads, kv_heads, head_dim, dtype_bytes, seq_first) -> int:
        """Paddle's flash_attn keeps q, k, v, its output, the fp32 log-sum-exp over the query length
        rounded up to 128 rows, and a seed/offset pair (read in Paddle's flash_attn_kernel.cu, not run)."""
        rows = -(-seq_len // LSE_ROW_MULTIPLE) * LSE_ROW_MULTIPLE
        return (_qkv_bytes(batch, seq_len, heads, kv_heads, head_dim, dtype_bytes)
                + batch * seq_len * heads * head_dim * dtype_bytes + batch * heads * rows * FP32_BYTES
                + SEED_OFFSET_BYTES)

    def keeps_output(self, seq_first: bool) -> bool:
        return not seq_first  # sequence first, the projection keeps the transposed copy


CORES = {core.name: core for core in (DenseCore(), BlockwiseCore(), FlashCore())}


def choose_core(use_flash_attention: bool, device: str, dtype: str | None, head_dim: int,
                sm: tuple[int, int] | None = None) -> tuple[AttentionCore, str | None]:
    """(the run's core, why flash was not taken although asked for, or None)."""
    if not use_flash_attention:
        return CORES["dense"], None
    refusal = flash_refusal(device, dtype, head_dim, sm)
    return (CORES["blockwise"], refusal) if refusal else (CORES["flash"], None)
