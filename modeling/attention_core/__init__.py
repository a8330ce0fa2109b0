"""The attention core: causal softmax(scale q k^T) v on one rank's heads under the layer's
`CoreSpec` (window, scale, soft-cap, ALiBi) and optional per-head sinks, chosen once per run
(torchtitan's inner attention) and handed to every attention block in the model's `Execution`.

The three cores compute the same function and differ in what they keep for backward, which each
states beside its code (`saved_bytes`: the planner's model, exact against the measurement on CPU):
- `dense`: the fp32 probabilities, seq^2 per head (the reference; PaddleNLP's path without flash);
- `blockwise`: q, k, v, the output and an fp32 log-sum-exp per query row, linear in seq (any device);
- `flash`: Paddle's FlashAttention-2 kernel (GPU, bf16/fp16), linear in seq.
Every core takes k and v with their own (kv) heads: grouped-query attention never repeats them; v
may have its own head size. A layer the run's core cannot compute (flash: a soft-cap, ALiBi, sinks,
v unlike q/k) is served by the blockwise core (`AttentionCore.serving`), and the run says which.

`choose_core`: `--use_flash_attention` (the default) takes flash where Paddle's kernel applies; on
CPU the dense core below `CPU_DENSE_BELOW` tokens (measured the faster there) where what it keeps
fits the rank's memory, blockwise elsewhere; `--no-use_flash_attention` takes dense, and
`--attention_core blockwise|dense` pins a core on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from modeling.attention_core import blockwise, flash
from modeling.attention_core.blockwise import DEFAULT_BLOCK, blockwise_causal_attention
from modeling.attention_core.dense import dense_causal_attention
from modeling.attention_core.flash import LSE_ROW_MULTIPLE, flash_causal_attention, flash_refusal, spec_refusal
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.documents import Documents
from paddle_pp.runtime.errors import UserError

FP32_BYTES, SEED_OFFSET_BYTES = 4, 16


@dataclass(frozen=True)
class Heads:
    """One rank's share of an attention call: query heads, kv heads, their q/k and v head sizes."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int

    def qkv_bytes(self, tokens: int, dtype_bytes: int) -> int:
        return tokens * (self.heads * self.qk_dim + self.kv_heads * (self.qk_dim + self.v_dim)) * dtype_bytes

    def output_bytes(self, tokens: int, dtype_bytes: int) -> int:
        return tokens * self.heads * self.v_dim * dtype_bytes


@dataclass(frozen=True)
class AttentionCore:
    """A causal attention function over q [.., heads, qk_dim], k [.., kv_heads, qk_dim] and v [..,
    kv_heads, v_dim] ([batch, seq, ...], or [seq, batch, ...] with `seq_first`), returning [..,
    heads x v_dim]."""

    name = "core"

    def __call__(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seq_first: bool,
                 spec: CoreSpec = PLAIN, sinks: paddle.Tensor | None = None,
                 documents: Documents | None = None) -> paddle.Tensor:
        """`documents`: the boundaries of a per-document call (`spec.documents`), else None."""
        raise NotImplementedError

    def refusal(self, spec: CoreSpec, sinks: bool, heads: Heads) -> str | None:
        """Why this core cannot compute a layer so declared (None: it can)."""
        return None

    def serving(self, spec: CoreSpec, sinks: bool, heads: Heads) -> AttentionCore:
        """The core that computes a layer so declared: this one, or the blockwise core where this
        one cannot."""
        return self if self.refusal(spec, sinks, heads) is None else CORES["blockwise"]

    def saved_bytes(self, batch: int, seq_len: int, heads: Heads, dtype_bytes: int, seq_first: bool,
                    spec: CoreSpec = PLAIN, sinks: bool = False) -> int:
        """What one call keeps for backward on a rank's `heads`."""
        raise NotImplementedError

    def ring_kernel(self, q_shape, kv_heads: int, v_dim: int, seq_first: bool, spec: CoreSpec):
        """How this core computes one block of ring attention (context parallelism), partial results
        merged by their log-sum-exp; the dense core keeps none, so it has no ring kernel."""
        raise NotImplementedError(f"the {self.name} core has no ring kernel")

    def keeps_output(self, seq_first: bool) -> bool:
        """Whether the tensor it returns is among what it keeps (then the output projection, which
        keeps its input, adds nothing)."""
        return False


@dataclass(frozen=True)
class DenseCore(AttentionCore):
    name = "dense"

    def __call__(self, q, k, v, seq_first, spec=PLAIN, sinks=None, documents=None):
        return dense_causal_attention(q, k, v, seq_first, spec, sinks, documents)

    def saved_bytes(self, batch, seq_len, heads, dtype_bytes, seq_first, spec=PLAIN, sinks=False) -> int:
        """The scaled q, k and v, and per score: the fp32 probabilities, their copy in the compute dtype
        (none in fp32) and the mask broadcast to the scores (a bool; per document, one per batch row
        too); a soft-cap keeps its tanh, and sinks one more column of probabilities (the sink's,
        dropped by a view after the softmax)."""
        scores = batch * heads.heads * seq_len * seq_len
        per_score = FP32_BYTES + 1 + (dtype_bytes if dtype_bytes < FP32_BYTES else 0)
        per_score += dtype_bytes if spec.softcap is not None else 0
        extra = batch * heads.heads * seq_len * FP32_BYTES if sinks else 0
        return heads.qkv_bytes(batch * seq_len, dtype_bytes) + scores * per_score + extra


@dataclass(frozen=True)
class BlockwiseCore(AttentionCore):
    name = "blockwise"
    block: int = DEFAULT_BLOCK

    def __call__(self, q, k, v, seq_first, spec=PLAIN, sinks=None, documents=None):
        return blockwise_causal_attention(q, k, v, seq_first, self.block, spec, sinks, documents)

    def ring_kernel(self, q_shape, kv_heads, v_dim, seq_first, spec):
        return blockwise.RingKernel(q_shape, kv_heads, v_dim, seq_first, self.block, spec)

    def saved_bytes(self, batch, seq_len, heads, dtype_bytes, seq_first, spec=PLAIN, sinks=False) -> int:
        """q, k and v as given, the output and an fp32 log-sum-exp per query row and head, whatever the
        spec (a window or documents shorten the work, not what is kept)."""
        tokens = batch * seq_len
        return (heads.qkv_bytes(tokens, dtype_bytes) + heads.output_bytes(tokens, dtype_bytes)
                + tokens * heads.heads * FP32_BYTES)

    def keeps_output(self, seq_first: bool) -> bool:
        return True


@dataclass(frozen=True)
class FlashCore(AttentionCore):
    name = "flash"

    def __call__(self, q, k, v, seq_first, spec=PLAIN, sinks=None, documents=None):
        return flash_causal_attention(q, k, v, seq_first, spec, spec.window_within(q.shape[0 if seq_first else 1]),
                                      documents)

    def refusal(self, spec: CoreSpec, sinks: bool, heads: Heads) -> str | None:
        return spec_refusal(spec, sinks, heads.qk_dim, heads.v_dim)

    def ring_kernel(self, q_shape, kv_heads, v_dim, seq_first, spec):
        return flash.RingKernel(q_shape, kv_heads, v_dim, seq_first, 0, spec)

    def saved_bytes(self, batch, seq_len, heads, dtype_bytes, seq_first, spec=PLAIN, sinks=False) -> int:
        """Paddle's flash_attn keeps q, k, v, its output, the fp32 log-sum-exp over the query length
        rounded up to 128 rows, and a seed/offset pair (read in Paddle's flash_attn_kernel.cu, not run);
        a windowed or per-document call (flashmask) also its int32 start rows, one per key and batch row."""
        rows = -(-seq_len // LSE_ROW_MULTIPLE) * LSE_ROW_MULTIPLE
        window_rows = batch * seq_len * 4 if spec.window_within(seq_len) is not None or spec.documents else 0
        return (heads.qkv_bytes(batch * seq_len, dtype_bytes) + heads.output_bytes(batch * seq_len, dtype_bytes)
                + batch * heads.heads * rows * FP32_BYTES + SEED_OFFSET_BYTES + window_rows)

    def keeps_output(self, seq_first: bool) -> bool:
        return not seq_first  # sequence first, the projection keeps the transposed copy


CORES = {core.name: core for core in (DenseCore(), BlockwiseCore(), FlashCore())}

# On CPU the dense core is the faster below this many tokens per sequence, blockwise from it on
# (bench/attention_cores.py, [1, seq, 9 heads (3 kv), 64], forward + backward, 2-core AMD EPYC:
# 512 tokens 0.093 s against 0.121, 1,024 0.36 against 0.35, 2,048 1.57 against 1.18)
CPU_DENSE_BELOW = 1024


@dataclass(frozen=True)
class DenseCost:
    """What the dense core would keep on one rank beyond the blockwise core (every layer's
    probabilities of one micro-batch, by the cores' own `saved_bytes`), and what the rank may spend
    on that: the dense core is taken on CPU only where it is the faster and this fits."""

    seq_len: int
    extra_bytes: int
    budget_bytes: int


class AttentionCoreError(UserError, ValueError):
    """Flags that ask for two different attention cores."""


PINNED = ("auto", "blockwise", "dense")  # --attention_core


def choose_core(use_flash_attention: bool, device: str, dtype: str | None, head_dim: int,
                sm: tuple[int, int] | None = None, dense_cost: DenseCost | None = None,
                pinned: str = "auto") -> tuple[AttentionCore, str | None]:
    """(the run's core, why it is not the flash core although asked for or which flag pinned it, or None).

    `--use_flash_attention` (the default) takes flash where Paddle's kernel applies; elsewhere, on
    CPU, the faster of the other two where its memory fits (`dense_cost`; without one, blockwise);
    `--no-use_flash_attention` takes dense. `--attention_core blockwise` or `dense` (`pinned`)
    takes that core whatever the device."""
    if pinned not in PINNED:
        raise AttentionCoreError(f"--attention_core {pinned}: not one of {', '.join(PINNED)}")
    if not use_flash_attention and pinned == "blockwise":
        raise AttentionCoreError("--no-use_flash_attention asks for the dense core and --attention_core blockwise for "
                                 "the blockwise one; drop one of them")
    if pinned != "auto":
        return CORES[pinned], f"--attention_core {pinned}"
    if not use_flash_attention:
        return CORES["dense"], None
    refusal = flash_refusal(device, dtype, head_dim, sm)
    if refusal is None:
        return CORES["flash"], None
    reason = f"flash attention not used: {refusal}"
    if device != "cpu" or dense_cost is None or dense_cost.seq_len >= CPU_DENSE_BELOW:
        return CORES["blockwise"], reason
    kept = f"its probabilities keep {_gib(dense_cost.extra_bytes)} more per micro-batch"
    budget = f"this rank's budget of {_gib(dense_cost.budget_bytes)}"
    if dense_cost.extra_bytes <= dense_cost.budget_bytes:
        return CORES["dense"], (f"{reason}; the dense core is the faster on CPU under {CPU_DENSE_BELOW} tokens and "
                                f"{kept}, within {budget}")
    return CORES["blockwise"], (f"{reason}; the dense core, the faster on CPU under {CPU_DENSE_BELOW} tokens, is "
                                f"not taken: {kept}, over {budget}")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
