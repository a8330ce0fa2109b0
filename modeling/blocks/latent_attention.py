"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) as a layer's attention part.

q is projected through a low-rank latent (`q_a_proj`, its RMSNorm `q_a_layernorm`, `q_b_proj`; or
one `q_proj` when `q_lora_rank` is null, V2-Lite), k and v through another (`kv_a_proj_with_mqa`,
whose last `rope_dim` outputs are one rotary key shared by every head, `kv_a_layernorm`,
`kv_b_proj`); each head's q and k are its `nope_dim` channels then its `rope_dim` rotary channels
(transformers' order, `concat(nope, rope)`), v has its own `v_dim`, and the softmax scale is
qk_head_dim^-1/2 times yarn's mscale^2 (the layer's `CoreSpec`). Rotary runs on the rope slice only,
on interleaved pairs (transformers' `rope_interleave`, V2's complex rotation).

Under tensor parallelism the heads split (`q_b_proj`/`q_proj` and `kv_b_proj` by columns, `o_proj` by
rows) and the latent projections and their norms stay whole on every tp rank. Without sequence
parallelism the column linears all-reduce their input's gradient, so the latents' and their weights'
gradients are complete on every rank; the shared rotary key bypasses `kv_b_proj` and each rank uses
it for its own heads only, so it passes an identity whose backward sums its gradient over tp (the
gradient Megatron, PaddleFleet and another framework each once left unsummed). Under sequence
parallelism the block's input is gathered once and every gradient into the latents is a rank's own
heads' part: the whole-on-every-rank weights (projections and norms) are marked as the norms under
SP are and summed over tp at the update, and the rotary key needs no sum (its part flows back with
the others, the gather's backward summing the input gradient).

With an `indexer` (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5) each query attends to the keys the
indexer selects, in latent attention's absorbed form (`attention_core/sparse.py`): each head's q_nope
is taken into the latent space through its rows of `kv_b_proj` (W_uk), every head attends to the
shared [latent, rotary key], and its latent output leaves through its W_uv rows; one gather of the
selected keys serves all heads. Without SP the latent's gradient is each rank's heads' part, summed by
an identity over tp, as the rotary key's; under SP the gather's backward sums it. The indexer's loss
(`blocks/indexer.py`) is injected where the layer is, scaled as the main loss. In the dense warm-up
(`IndexerTraining.dense`) the layer attends as DeepSeek-V3's does, to every earlier key, and the
indexer's loss is taken over every key towards that attention (O(heads x seq^2): the warm-up's cost).

Under context parallelism the ring carries each head's expanded k (192 wide) and v (128), not the
latent (576 per token for all heads): the expanded tensors are what every core and the ring already
compute on, and carrying the latent would rerun `kv_b_proj` on every block of every ring step,
forward and backward, for each of the cp - 1 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import paddle
from paddle.autograd import PyLayer
from paddle.distributed import collective

from modeling.attention_core import AttentionCore, Heads
from modeling.attention_core.sparse import selected_attention, selected_attention_saved_bytes
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.blocks.attention import QueryTemperature
from modeling.blocks.indexer import (
    Indexer,
    Selection,
    dense_target,
    every_score,
    indexer_loss,
    key_starts,
    select,
    selected_scores,
    summed_over_heads,
    visible_keys,
)
from modeling.blocks.norms import FP32_BYTES, rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Declared, Norm, Part, RowLinear, WholeLinear
from modeling.blocks.rotary import Rotary
from modeling.execution import Execution, recomputing
from modeling.injected_loss import inject
from modeling.sequence_parallel import gather_tokens


@dataclass(frozen=True)
class LatentAttention(Declared):
    recurrent: ClassVar[bool] = False  # a token mixer with an attention core (see blocks/gated_delta.py)
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    eps: float
    bias: bool = False  # transformers' attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    spec: CoreSpec = PLAIN
    rotary: Rotary | None = None
    temperature: QueryTemperature | None = None  # Mistral 4's query scales by position (llama_4_scaling_beta)
    indexer: Indexer | None = None  # DeepSeek Sparse Attention's: each query sees its selected keys only
    hands_on_selection: bool = False  # GLM-5.2: its selection is the next layers' (returned beside the output)
    reused_topk: int | None = None  # GLM-5.2's shared layers: no indexer, an earlier layer's selection of this many
    output = "o_proj"
    sinks = False

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def sparse(self) -> bool:
        """Whether each query attends to selected keys (its own indexer's or an earlier layer's)."""
        return self.indexer is not None or self.reused_topk is not None

    def parts(self) -> dict[str, Part]:
        if self.q_lora_rank:
            query: dict[str, Part] = {"q_a_proj": WholeLinear(self.hidden, self.q_lora_rank, self.bias),
                                      "q_a_layernorm": Norm(self.q_lora_rank, self.eps),
                                      "q_b_proj": ColumnLinear(self.q_lora_rank, self.heads * self.qk_dim)}
        else:
            query = {"q_proj": ColumnLinear(self.hidden, self.heads * self.qk_dim)}
        indexer = {"indexer": self.indexer} if self.indexer is not None else {}
        return {**query, **indexer,
                "kv_a_proj_with_mqa": WholeLinear(self.hidden, self.kv_lora_rank + self.rope_dim, self.bias),
                "kv_a_layernorm": Norm(self.kv_lora_rank, self.eps),
                "kv_b_proj": ColumnLinear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim)),
                self.output: RowLinear(self.heads * self.v_dim, self.hidden, self.bias)}

    def own_tp_units(self) -> dict[str, int]:
        return {"num_attention_heads": self.heads}

    def local_heads(self, run: Execution) -> Heads:
        return Heads(self.heads // run.tp, self.heads // run.tp, self.qk_dim, self.v_dim)

    def core(self, run: Execution) -> AttentionCore:
        return run.attention.serving(self.spec, False, self.local_heads(run))

    def core_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int, int]:
        heads = self.local_heads(run)
        kept = self.core(run).saved_bytes(batch, seq_len, heads, dtype_bytes, run.sequence_first,
                                          run.spec_for(self.spec))
        return kept, heads.qkv_bytes(batch * seq_len, dtype_bytes), heads.output_bytes(batch * seq_len, dtype_bytes)

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward (the planner's model, equal to the measurement in fp32): the
        input (shared by the down projections, kept by the first), each latent's norm and its normed
        output, the core's own and the output projection's input unless the core keeps it, the
        rotary tables as `Rotary.kept_bytes` says; the splits, concatenations and the shared key's
        broadcast to every head keep nothing."""
        tokens = batch * seq_len
        kept, _, output = self.core_bytes(run, batch, seq_len, dtype_bytes)
        first = "q_a_proj" if self.q_lora_rank else "q_proj"
        rotary = self.rotary.kept_bytes(batch, seq_len, dtype_bytes, run.documents is not None) if self.rotary else 0
        scaled = tokens * self.local_heads(run).heads * self.qk_dim * dtype_bytes if self.temperature else 0
        saved = {first: tokens * self.hidden * dtype_bytes, "": kept + rotary + scaled,
                 "kv_a_layernorm": rms_norm_saved_bytes(tokens, self.kv_lora_rank, dtype_bytes, False),
                 "kv_b_proj": tokens * self.kv_lora_rank * dtype_bytes,
                 self.output: 0 if self.core(run).keeps_output(run.sequence_first) else output}
        if self.q_lora_rank:
            saved |= {"q_a_layernorm": rms_norm_saved_bytes(tokens, self.q_lora_rank, dtype_bytes, False),
                      "q_b_proj": tokens * self.q_lora_rank * dtype_bytes}
        if self.sparse:
            saved |= self._sparse_saved_bytes(run, batch, seq_len, dtype_bytes)
        return saved

    def _sparse_saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What the sparse stage's call keeps where it differs from the expanded one (measured in fp32 by
        `tests/test_family_activations.py`): each head's q_nope taken to the latent and the per-head
        rows of `kv_b_proj` that absorb (a [heads, kv_lora_rank, nope + v] copy, whatever the length),
        the selected-key core's q, keys, int64 indices, their bool visibility, output and fp32
        log-sum-exp (`selected_attention_saved_bytes`), the output projection's input (`kv_b_proj`
        itself is not called); the indexer's LayerNorm (its input, fp32 mean and variance), rotary
        tables, and the inputs its loss is recomputed from (index queries, keys, fp32 head weights)."""
        tokens, heads, indexer = batch * seq_len, self.local_heads(run).heads, self.indexer
        latent_dim = self.kv_lora_rank + self.rope_dim
        k = min(indexer.topk if indexer is not None else self.reused_topk, seq_len)
        core = selected_attention_saved_bytes(batch, seq_len, heads, latent_dim, self.kv_lora_rank, k, dtype_bytes)
        absorbed = tokens * heads * self.nope_dim * dtype_bytes + heads * self.kv_lora_rank * (
            self.nope_dim + self.v_dim) * dtype_bytes
        documents = run.documents is not None
        rotary = self.rotary.kept_bytes(batch, seq_len, dtype_bytes, documents) if self.rotary else 0
        saved = {"": absorbed + core + rotary, "kv_b_proj": 0, self.output: tokens * heads * self.v_dim * dtype_bytes}
        if indexer is None:  # a layer reusing an earlier layer's selection
            return saved
        saved[""] += tokens * (indexer.heads * indexer.head_dim + indexer.head_dim) * dtype_bytes + \
            tokens * indexer.heads * FP32_BYTES  # the loss's inputs
        return saved | {"indexer": indexer.rotary.kept_bytes(batch, seq_len, dtype_bytes, documents),
                        "indexer.k_norm": tokens * indexer.head_dim * dtype_bytes + 2 * tokens * FP32_BYTES}


class LatentSelfAttention(Block):
    def __init__(self, config, run: Execution, declared: LatentAttention):
        super().__init__(config, run, declared)
        self.heads = declared.local_heads(run)
        self.attend = declared.core(run)
        # the shared rotary key's gradient, each tp rank's own heads' part, summed over tp (without SP)
        self.sums_rotary_key = run.tp > 1 and not run.sequence_first

    def forward(self, hidden, positions=None, shared=None):
        """`positions`: each token's position in its document under per-document attention, else None.
        `shared`: (the selection an earlier layer handed on,) for a layer reusing one. A layer handing
        its selection on returns (output, selection) (in the dense warm-up an empty one: `handed_on`)."""
        declared, run, heads = self.declared, self.run, self.heads.heads
        hidden = gather_tokens(hidden, run)
        if declared.sparse and not run.indexers.dense:
            return self._sparse(hidden, positions, shared)
        seq_first = run.sequence_first
        lead = hidden.shape[:2]
        q_latent, q_nope, q_rot, latent, k_rot = self._latents(hidden, seq_first, positions)
        keys = self.kv_b_proj(latent).reshape(lead + [heads, declared.nope_dim + declared.v_dim])
        k_nope, v = paddle.split(keys, [declared.nope_dim, declared.v_dim], axis=-1)
        q = paddle.concat([q_nope, q_rot], axis=-1)
        if declared.temperature is not None:
            q = declared.temperature.apply(q, run, positions)
        k = paddle.concat([k_nope, k_rot.expand(lead + [heads, declared.rope_dim])], axis=-1)
        spec, documents = run.spec_for(declared.spec), run.documents_at(positions)
        out = run.recompute("core_attn", lambda *qkv: self.attend(*qkv, seq_first, spec, None, documents), q, k, v,
                            training=self.training)
        out = self.o_proj(out)
        if declared.indexer is None:
            return out
        # the dense warm-up: every key attended, the indexer trained towards that attention over every key
        batch_first = (lambda t: t.transpose([1, 0] + list(range(2, len(t.shape))))) if seq_first else (lambda t: t)
        index_q, index_k, index_w = self.indexer(batch_first(hidden).detach(), batch_first(q_latent).detach(), positions)
        batch, seq = index_k.shape[:2]
        starts = key_starts(positions if run.within_documents else None, batch, seq)
        scale = declared.spec.softmax_scale(declared.qk_dim)
        out = self._trains_indexer(out, (index_q, index_k, index_w), every_score, visible_keys(starts, seq),
                                   lambda: dense_target(batch_first(q), batch_first(k), starts, scale))
        return (out, handed_on(None, batch, seq, declared.indexer.topk)) if declared.hands_on_selection else out

    def _latents(self, hidden, seq_first: bool, positions):
        """(the query latent, None without `q_lora_rank`; q's nope and rotated rope parts [.., heads, dim];
        the normed kv latent; the rotated shared key [.., 1, rope_dim]) of `hidden` ([seq, batch, ..] when
        `seq_first`, else batch first). The shared key's gradient is each tp rank's heads' part without
        SP: an identity sums it over tp."""
        declared, run = self.declared, self.run
        lead = hidden.shape[:2]
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden)) if declared.q_lora_rank else None
        query = self.q_b_proj(q_latent) if declared.q_lora_rank else self.q_proj(hidden)
        q_nope, q_rot = paddle.split(query.reshape(lead + [self.heads.heads, declared.qk_dim]),
                                     [declared.nope_dim, declared.rope_dim], axis=-1)
        latent, k_rot = paddle.split(self.kv_a_proj_with_mqa(hidden), [declared.kv_lora_rank, declared.rope_dim],
                                     axis=-1)
        k_rot = k_rot.reshape(lead + [1, declared.rope_dim])
        if self.sums_rotary_key:
            k_rot = collective._c_identity(k_rot, group=run.tp_group)
        if declared.rotary is not None:
            q_rot, k_rot = declared.rotary.rotate(q_rot, k_rot, seq_first, run.kernels.fused_rope, run.cp, positions)
        return q_latent, q_nope, q_rot, self.kv_a_layernorm(latent), k_rot

    def _sparse(self, hidden, positions, shared=None):
        """Attention over the indexer's selection (or the one an earlier layer `shared`), absorbed (the
        module docstring), batch first inside."""
        declared, run, heads = self.declared, self.run, self.heads.heads
        if run.sequence_first:
            hidden = hidden.transpose([1, 0, 2])
        batch, seq = hidden.shape[:2]
        q_latent, q_nope, q_rot, latent, k_rot = self._latents(hidden, False, positions)
        if self.sums_rotary_key:  # kv_b_proj's rows are used directly: its input identity is this one
            latent = collective._c_identity(latent, group=run.tp_group)
        absorbed = self.kv_b_proj.weight.reshape([declared.kv_lora_rank, heads, declared.nope_dim + declared.v_dim])
        into_latent, out_of_latent = paddle.split(absorbed.transpose([1, 0, 2]), [declared.nope_dim, declared.v_dim],
                                                  axis=-1)  # [heads, kv_lora_rank, nope_dim], [.., v_dim]
        q_latent_heads = paddle.matmul(q_nope.transpose([2, 0, 1, 3]).reshape([heads, batch * seq, -1]),
                                       into_latent, transpose_y=True)
        q = paddle.concat([q_latent_heads.reshape([heads, batch, seq, -1]).transpose([1, 2, 0, 3]), q_rot], axis=-1)
        keys = paddle.concat([latent, k_rot.squeeze(2)], axis=-1)
        if declared.indexer is not None:
            index_q, index_k, index_w = self.indexer(hidden.detach(), q_latent.detach(), positions)
            starts = key_starts(positions if run.within_documents else None, batch, seq)
            selection = select(index_q, index_k, index_w, starts, declared.indexer.topk)
        else:
            selection = taken_over(shared[0])
        out, target = selected_attention(q, keys, selection.indices, selection.visible, declared.kv_lora_rank,
                                         declared.spec.softmax_scale(declared.qk_dim))
        out = paddle.matmul(out.transpose([2, 0, 1, 3]).reshape([heads, batch * seq, -1]), out_of_latent)
        out = out.reshape([heads, batch, seq, declared.v_dim]).transpose([1, 2, 0, 3]).reshape([batch, seq, -1])
        if run.sequence_first:
            out = out.transpose([1, 0, 2])
        out = self.o_proj(out)
        if declared.indexer is None:
            return out
        out = self._trains_indexer(out, (index_q, index_k, index_w), lambda *index: selected_scores(*index, selection),
                                   selection.visible, lambda: target)
        return (out, handed_on(selection, batch, seq, declared.indexer.topk)) if declared.hands_on_selection else out

    def _trains_indexer(self, out, index, scores_of, visible, target):
        """`out`, with the indexer's loss injected while training: KL(the heads' attention summed over tp,
        made by `target` only then || softmax(`scores_of(*index)`)) over the `visible` keys. Recomputed in
        backward from the index queries, keys and weights (`index`): the scores' gradient would otherwise
        keep each query's gathered index keys (seq x k x index_head_dim)."""
        run = self.run
        learning, counting = self.training and paddle.is_grad_enabled(), self.training and not recomputing()
        if not (learning or counting):
            return out
        target = summed_over_heads(target(), run)

        def loss_of(q, keys, weights):
            return indexer_loss(scores_of(q, keys, weights), visible, target)

        loss = _RecomputedLoss.apply(loss_of, *index) if learning else loss_of(*index)
        if counting:
            run.indexers.losses.append(loss.detach())
        if learning:  # at coef 0 too: a zero gradient, never a missing one (fused gradient buffers count on it)
            out = inject(out, loss * run.indexers.coef / run.accumulate_steps)
        return out


def handed_on(selection: Selection | None, batch: int, seq: int, topk: int) -> paddle.Tensor:
    """A selection as it travels to the layers reusing it (GLM-5.2's shared layers, `blocks/carried.py`):
    fp32 [batch, seq, k], each selected key's index, -1 where the query may not see it (exact: positions
    below 2^24); in the dense warm-up (None) all -1, which those layers, attending densely, do not read."""
    if selection is None:
        return paddle.full([batch, seq, min(topk, seq)], -1.0, "float32")
    handed = paddle.where(selection.visible, selection.indices.astype("float32"),
                          paddle.full(selection.indices.shape, -1.0, "float32"))
    handed.stop_gradient = True
    return handed


def taken_over(handed: paddle.Tensor) -> Selection:
    """The selection `handed_on` made."""
    return Selection(paddle.clip(handed, min=0).astype("int64"), handed >= 0)


class _RecomputedLoss(PyLayer):
    """`loss_of(*inputs)`, keeping only its inputs for the backward, which runs it again with autograd
    (the indexer's loss: its scores' gradient would keep each query's gathered index keys). A PyLayer
    rather than fleet's recompute: Paddle allows one pair of saved-tensor hooks at a time, which a
    recompute of the whole layer without reentry (or a measurement of what it keeps) already holds."""

    @staticmethod
    def forward(ctx, loss_of, *inputs):
        ctx.loss_of = loss_of
        ctx.save_for_backward(*inputs)
        ctx.needed = [not tensor.stop_gradient for tensor in inputs]  # Paddle wants None for the others
        with paddle.no_grad():
            return loss_of(*inputs)

    @staticmethod
    def backward(ctx, d_loss):
        leaves = [tensor.detach() for tensor in ctx.saved_tensor()]
        for leaf in leaves:
            leaf.stop_gradient = False
        with paddle.enable_grad():
            loss = ctx.loss_of(*leaves)
        grads = paddle.grad([loss], leaves, [d_loss], allow_unused=True)
        return tuple((paddle.zeros_like(leaf) if grad is None else grad) if needed else None
                     for grad, leaf, needed in zip(grads, leaves, ctx.needed))


LatentAttention.layer = LatentSelfAttention
