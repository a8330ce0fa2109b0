"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which keys each query's
latent attention sees, and the loss that trains it.

Index queries come from the attention's query latent (`wq_b` of `q_a_layernorm`'s output), one index
key per token from the hidden state (`wk`, a LayerNorm `k_norm`), per-head weights too
(`weights_proj`, times heads^-1/2); the first `rope_dim` channels of each rotate (DeepSeek-V3.2 by
halves, GLM-5 by interleaved pairs). A query's score of key s is sum_j w_j relu(scale q_j . k_s); it
keeps its `topk` best earlier keys of its own document (all of them when it has fewer), chosen one
block of queries at a time (O(block x seq) at once, as transformers' indexer in a loop).

The indexer is trained by its own loss only (the DeepSeek-V3.2 report): the KL divergence from the
main attention's probabilities at the selected keys, summed over every head and normalised, to the
softmax of the index scores there, averaged over the queries (Megatron's `compute_dsa_indexer_loss`
with `sparse_loss`). Its inputs are detached, so the language-model loss never reaches it and its loss
never reaches the model; the selection itself carries no gradient. Every tp rank holds it whole and
computes it on the whole sequence (the block gathers it under SP) towards the same target (the heads'
probabilities summed over tp), so each rank's gradient is the whole one and is never summed
(`WholeLinear.computed_whole`).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

from modeling.attention_core.sparse import gathered, masked
from modeling.blocks.parts import Block, Declared, Norm, Part, WholeLinear
from modeling.blocks.rotary import Rotary
from modeling.execution import Execution

FP32 = "float32"
K_NORM_EPS = 1e-6  # transformers' and DeepSeek's LayerNorm of the index key
SELECT_BLOCK = 512  # queries scored at once while selecting: [batch, block, heads, seq] scores


@dataclass(frozen=True)
class Selection:
    """Each query's selected keys: `indices` int64 [batch, seq, k] and whether it may see each
    (`visible`, bool: an index past it or before its document, which a short row's top-k fills up with,
    is not)."""

    indices: paddle.Tensor
    visible: paddle.Tensor


@dataclass(frozen=True)
class Indexer(Declared):
    hidden: int
    q_lora_rank: int
    heads: int
    head_dim: int
    topk: int
    rotary: Rotary

    def parts(self) -> dict[str, Part]:
        return {"wq_b": WholeLinear(self.q_lora_rank, self.heads * self.head_dim, computed_whole=True),
                "wk": WholeLinear(self.hidden, self.head_dim, computed_whole=True),
                "k_norm": Norm(self.head_dim, K_NORM_EPS, layer_norm=True, computed_whole=True),
                "weights_proj": WholeLinear(self.hidden, self.heads, computed_whole=True)}


def is_indexer_parameter(name: str) -> bool:
    """Whether a model's parameter of this structured name is an indexer's (under any layout: the
    pipeline's layers keep their single-card names)."""
    return ".indexer." in name


def key_starts(positions: paddle.Tensor | None, batch: int, seq: int) -> paddle.Tensor:
    """int64 [batch, seq]: the first key each query may see (its document's first token; 0 without documents)."""
    if positions is None:
        return paddle.zeros([batch, seq], "int64")
    return paddle.arange(seq, dtype="int64").unsqueeze(0) - positions.astype("int64")


def _seen_at(keys: paddle.Tensor, starts: paddle.Tensor, i0: int, i1: int) -> paddle.Tensor:
    """bool, as `keys` [batch or 1, i1 - i0, n]: whether queries i0..i1 may see those key positions
    (earlier, inside their documents)."""
    queries = paddle.arange(i0, i1, dtype="int64").reshape([1, -1, 1])
    return paddle.logical_and(keys <= queries, keys >= starts[:, i0:i1].unsqueeze(-1))


def _visible(starts: paddle.Tensor, i0: int, i1: int, seq: int) -> paddle.Tensor:
    """bool [batch, i1 - i0, seq]: the keys queries i0..i1 may see."""
    return _seen_at(paddle.arange(seq, dtype="int64").reshape([1, 1, seq]), starts, i0, i1)


class IndexerLayer(Block):
    def forward(self, hidden: paddle.Tensor, q_latent: paddle.Tensor, positions: paddle.Tensor | None):
        """(index queries [batch, seq, heads, head_dim], index keys [batch, seq, head_dim], head weights
        [batch, seq, heads]) of the batch-first hidden states and query latent (both detached)."""
        declared = self.declared
        batch, seq = hidden.shape[:2]
        q = self.wq_b(q_latent).reshape([batch, seq, declared.heads, declared.head_dim])
        k = self.k_norm(self.wk(hidden)).reshape([batch, seq, 1, declared.head_dim])
        q, k = declared.rotary.rotate(q, k, False, False, (1, 0), positions)
        weights = self.weights_proj(hidden).astype(FP32) * declared.heads ** -0.5
        return q, k.squeeze(2), weights


def index_scores(q: paddle.Tensor, keys: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
    """fp32 [batch, n, k]: sum_j w_j relu(q_j . key / sqrt(head_dim)) of queries q [batch, n, heads,
    head_dim] against keys [batch, n, k, head_dim] (each query's own) or [batch, 1, k, head_dim] (shared)."""
    scores = F.relu(paddle.matmul(q.astype(FP32), keys.astype(FP32), transpose_y=True) * q.shape[-1] ** -0.5)
    return paddle.matmul(weights.unsqueeze(2), scores).squeeze(2)


@paddle.no_grad()
def select(q: paddle.Tensor, keys: paddle.Tensor, weights: paddle.Tensor, starts: paddle.Tensor,
           topk: int) -> Selection:
    """Each query's `topk` best keys among those it may see (ties at the boundary as paddle.topk breaks them)."""
    batch, seq = keys.shape[:2]
    k = min(topk, seq)
    indices, visible = [], []
    for i0 in range(0, seq, SELECT_BLOCK):
        i1 = min(i0 + SELECT_BLOCK, seq)
        scores = masked(index_scores(q[:, i0:i1], keys.unsqueeze(1), weights[:, i0:i1]), _visible(starts, i0, i1, seq))
        chosen = paddle.topk(scores, k, axis=-1)[1]
        indices.append(chosen)
        visible.append(_seen_at(chosen, starts, i0, i1))
    return Selection(paddle.concat(indices, axis=1), paddle.concat(visible, axis=1))


def indexer_loss(scores: paddle.Tensor, visible: paddle.Tensor, target: paddle.Tensor) -> paddle.Tensor:
    """The mean over queries of KL(target || softmax of the index `scores`) over the keys each may see
    (`visible`); `target` is the main attention's probabilities there summed over all heads (fp32, no
    gradient), normalised here. Its gradient reaches the indexer through `scores`."""
    log_index = F.log_softmax(masked(scores, visible), axis=-1)
    target = target / target.sum(-1, keepdim=True)
    seen = target > 0
    terms = paddle.where(seen, target * (paddle.log(paddle.where(seen, target, paddle.ones_like(target))) -
                                         paddle.where(seen, log_index, paddle.zeros_like(log_index))),
                         paddle.zeros_like(target))
    return terms.sum(-1).mean()


def selected_scores(q: paddle.Tensor, keys: paddle.Tensor, weights: paddle.Tensor,
                    selection: Selection) -> paddle.Tensor:
    """The index scores [batch, seq, k] of each query's selected keys (the sparse stage's loss)."""
    return index_scores(q, gathered(keys, selection.indices), weights)


def every_score(q: paddle.Tensor, keys: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
    """The index scores [batch, seq, seq] of every key (the dense warm-up's loss: O(heads x seq^2))."""
    return index_scores(q, keys.unsqueeze(1), weights)


def visible_keys(starts: paddle.Tensor, seq: int) -> paddle.Tensor:
    """bool [batch, seq, seq]: the keys each query may see."""
    return _visible(starts, 0, seq, seq)


@paddle.no_grad()
def dense_target(q: paddle.Tensor, k: paddle.Tensor, starts: paddle.Tensor, scale: float) -> paddle.Tensor:
    """fp32 [batch, seq, seq]: dense attention's probabilities of every key summed over the heads of q
    [batch, seq, heads, dim] and k (as many heads), a block of queries at a time (the warm-up's target)."""
    seq = k.shape[1]
    keys = k.astype(FP32).transpose([0, 2, 1, 3])  # [batch, heads, seq, dim]
    sums = []
    for i0 in range(0, seq, SELECT_BLOCK):
        i1 = min(i0 + SELECT_BLOCK, seq)
        scores = paddle.matmul(q[:, i0:i1].astype(FP32).transpose([0, 2, 1, 3]), keys, transpose_y=True) * scale
        probs = F.softmax(masked(scores, _visible(starts, i0, i1, seq).unsqueeze(1)), axis=-1)
        sums.append(probs.sum(1))
    return paddle.concat(sums, axis=1)


def summed_over_heads(target: paddle.Tensor, run: Execution) -> paddle.Tensor:
    """A rank's heads' probabilities summed, then over the tp ranks' heads (every head's sum)."""
    if run.tp > 1:
        target = target.clone()
        dist.all_reduce(target, group=run.tp_group)
    return target


Indexer.layer = IndexerLayer
