"""What one attention call computes besides causal softmax(q k^T) v, as a layer declares it and
every core honours it (torchtitan hands its inner attention a mask spec; Megatron has
`window_size`): the softmax scale, a sliding window, chunks, a soft-cap on the scores and ALiBi slopes.
Per-head sink logits are a parameter, so they travel beside the spec as a tensor; so do a
per-document run's document boundaries (`modeling/documents.py`), which the spec only announces.

Semantics are transformers': a query at position i sees keys j with i - window < j <= i (`window`
keys, itself included); with `chunk` (Llama 4's `attention_chunk_size`) only the keys of its own chunk
of that many positions, j >= chunk x floor(i / chunk): a document boundary every `chunk` positions,
which every core computes as it computes documents (`Execution.documents_at`: O(s x chunk) in the
blockwise core, flashmask's start rows, the ring's per-query bounds); scores are `scale` q.k, then `softcap` * tanh(score / softcap) (Gemma 2),
then plus slope_h * (j - i) (ALiBi: MPT, BLOOM; transformers adds slope_h * j, which differs per
row by a constant the softmax cancels); sinks add one value-less logit per head to every row's
softmax (GPT-OSS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CoreSpec:
    """`scale` None is qk_head_dim^-1/2; `alibi` holds the slopes of the query heads the call
    sees (a tp rank's share); `documents`: each query sees only the keys of its own document;
    `chunk`: only the keys of its own chunk (the call's documents start at chunks too)."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    alibi: tuple[float, ...] | None = None
    documents: bool = False
    chunk: int | None = None

    def softmax_scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1 / math.sqrt(head_dim)

    def window_within(self, seq_len: int) -> int | None:
        """The window where it is shorter than `seq_len` positions (else it masks nothing: None)."""
        return self.window if self.window is not None and self.window < seq_len else None

    def local(self, heads: int, tp: int, tp_rank: int) -> CoreSpec:
        """This spec for tp rank `tp_rank`'s share of `heads` query heads (its ALiBi slopes)."""
        if self.alibi is None or tp == 1:
            return self
        share = heads // tp
        return replace(self, alibi=self.alibi[tp_rank * share:(tp_rank + 1) * share])


PLAIN = CoreSpec()


def alibi_slopes(heads: int, max_bias: float = 8.0) -> tuple[float, ...]:
    """ALiBi's per-head slopes (Press et al.): 2^(-max_bias x (h + 1) / n) for n the power of two at
    least `heads`, the odd-numbered ones of 2n taken when heads is not a power of two (MPT's
    `build_alibi_bias` with `alibi_bias_max`; BLOOM's, whose max_bias is 8)."""
    n = 2 ** math.ceil(math.log2(heads))
    slopes = [2 ** (-max_bias * (h + 1) / n) for h in range(n)]
    if n != heads:
        slopes = slopes[1::2] + slopes[::2]
    return tuple(slopes[:heads])
