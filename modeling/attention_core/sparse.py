"""Attention over each query's own selected keys (DeepSeek Sparse Attention's core): softmax(scale q
k_S^T) v_S where S is the query's top-k keys (`blocks/indexer.py` chooses them), in time and memory
O(seq x k), never a seq x seq mask.

Latent attention runs here in its absorbed form (DeepSeek's MQA mode, the one DSA is defined in): every
head's query is moved into the latent space ([q_nope W_uk_h, q_rope], `kv_lora_rank + rope_dim` wide)
and attends to one key per token shared by all heads, [latent, k_rope], whose first `value_dim`
channels (the latent) are also its value; each head's output, still latent, goes through W_uv_h after
the core. So the keys a block of queries selects are gathered once for all heads (k x 576 per query
for DeepSeek-V3.2, against k x heads x 192 expanded).

Forward walks blocks of queries: gather their selected keys, score them, softmax with a log-sum-exp
per (query, head) row, the weighted sum of the values. Backward keeps only q, the keys, the indices,
the output and the log-sum-exp, regathers each block's keys, recomputes its probabilities and
scatter-adds the keys' gradient back to the positions they came from. A selected entry a query may
not see (an index past the query, before its document, or a repeat of a shorter row's top-k) is
masked by `visible`; every row sees at least its own key.

The forward also returns, without gradient, each query's probabilities summed over the call's heads
at its selected keys: the target the indexer is trained towards (summed over tp by the caller).
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from modeling.autocast import full_precision
from modeling.saved_tensors import kept
from paddle_pp.runtime.normal_range import exp_normal, flush_subnormals_

FP32, FP32_BYTES = "float32", 4
QUERY_BLOCK = 256  # queries per block: their gathered keys are QUERY_BLOCK x k x (kv_lora_rank + rope_dim)


def _rows(indices: paddle.Tensor, seq: int) -> paddle.Tensor:
    """indices [batch, n, k] into a batch's sequences of `seq` as rows of them all flattened, [batch x n x k]."""
    offsets = (paddle.arange(indices.shape[0], dtype="int64") * seq).reshape([-1, 1, 1])
    return (indices + offsets).reshape([-1])


def gathered(keys: paddle.Tensor, indices: paddle.Tensor) -> paddle.Tensor:
    """keys [batch, seq, dim] at indices [batch, n, k] -> [batch, n, k, dim]."""
    batch, seq, dim = keys.shape
    return paddle.gather(keys.reshape([batch * seq, dim]), _rows(indices, seq)).reshape(indices.shape + [dim])


def masked(scores: paddle.Tensor, visible: paddle.Tensor) -> paddle.Tensor:
    """fp32 `scores`, -inf where not `visible` (broadcast)."""
    return paddle.where(visible, scores, paddle.full([], float("-inf"), FP32))


def _scores(q_block, keys, visible, scale):
    """fp32 [batch, n, heads, k]: scale q.k at the selected keys, -inf where not visible."""
    return masked(paddle.matmul(q_block, keys, transpose_y=True).astype(FP32) * scale, visible.unsqueeze(2))


def _blocks(seq: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, seq)) for i in range(0, seq, block)]


class _SelectedAttention(PyLayer):
    @staticmethod
    def forward(ctx, q, keys, indices, visible, value_dim: int, scale: float, block: int):
        outputs, sums, targets = [], [], []
        with full_precision():
            for i0, i1 in _blocks(q.shape[1], block):
                selected = gathered(keys, indices[:, i0:i1])
                scores = _scores(q[:, i0:i1], selected, visible[:, i0:i1], scale)
                high = scores.max(-1, keepdim=True)
                probs = exp_normal(scores - high)
                total = probs.sum(-1, keepdim=True)
                probs = probs / total
                outputs.append(paddle.matmul(probs.astype(q.dtype), selected[..., :value_dim]))
                sums.append(high + paddle.log(total))
                targets.append(probs.sum(2))
            out, lse = paddle.concat(outputs, axis=1), paddle.concat(sums, axis=1)
        ctx.save_for_backward(*kept(q, keys, indices, visible, out, lse))
        ctx.layout = (value_dim, scale, block)
        target = paddle.concat(targets, axis=1)
        ctx.mark_non_differentiable(target)
        return out, target

    @staticmethod
    def backward(ctx, dout, _dtarget):
        q, keys, indices, visible, out, lse = ctx.saved_tensor()
        value_dim, scale, block = ctx.layout
        batch, seq, dim = keys.shape
        dq, dkeys = [], paddle.zeros([batch * seq, dim], FP32)
        with full_precision():
            for i0, i1 in _blocks(q.shape[1], block):
                selected = gathered(keys, indices[:, i0:i1])
                q_block, dout_block = q[:, i0:i1], dout[:, i0:i1].astype(FP32)
                probs = exp_normal(_scores(q_block, selected, visible[:, i0:i1], scale) - lse[:, i0:i1])
                delta = (dout_block * out[:, i0:i1].astype(FP32)).sum(-1, keepdim=True)
                dprobs = paddle.matmul(dout_block, selected[..., :value_dim].astype(FP32), transpose_y=True)
                dscores = flush_subnormals_(probs * (dprobs - delta)) * scale
                dq.append(paddle.matmul(dscores, selected.astype(FP32)))
                dselected = paddle.matmul(dscores, q_block.astype(FP32), transpose_x=True)  # [b, n, k, dim]
                dvalues = paddle.matmul(probs, dout_block, transpose_x=True)  # [b, n, k, value_dim]
                dselected = paddle.concat([dselected[..., :value_dim] + dvalues, dselected[..., value_dim:]], axis=-1)
                dkeys = paddle.index_add(dkeys, _rows(indices[:, i0:i1], seq), 0, dselected.reshape([-1, dim]))
        return (paddle.concat(dq, axis=1).astype(q.dtype), dkeys.reshape([batch, seq, dim]).astype(keys.dtype),
                None, None)


def selected_attention(q: paddle.Tensor, keys: paddle.Tensor, indices: paddle.Tensor, visible: paddle.Tensor,
                       value_dim: int, scale: float,
                       block: int = QUERY_BLOCK) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(output [batch, seq, heads, value_dim], the probabilities summed over heads at each query's
    selected keys [batch, seq, k] without gradient) of q [batch, seq, heads, dim] against one key per
    token [batch, seq, dim] (its first `value_dim` channels the value), each query attending to the
    keys `indices` [batch, seq, k] (int64) names where `visible` [batch, seq, k] says so."""
    return _SelectedAttention.apply(q, keys, indices, visible, value_dim, scale, block)


def selected_attention_saved_bytes(batch: int, seq_len: int, heads: int, dim: int, value_dim: int, k: int,
                                   dtype_bytes: int) -> int:
    """What one call keeps for backward: q, the keys, the int64 indices and their bool visibility,
    the output and an fp32 log-sum-exp per (query, head)."""
    tokens = batch * seq_len
    return tokens * (heads * dim + dim + heads * value_dim) * dtype_bytes + tokens * k * 9 + tokens * heads * FP32_BYTES
