"""Self-attention as a layer declares it (`Attention`): q/k/v/o projections (optional biases),
grouped-query heads with their own head size (v's may differ from q's and k's), optional q/k norms
per head (Qwen3, Gemma 3) or over the whole projection (OLMoE, OLMo-2), q/k/v clipping (MPT's
`clip_qkv`), the layer's rotary (or none), its `CoreSpec` (window, scale, soft-cap, ALiBi) and
per-head sinks; computed by the run's attention core on this tp rank's heads (or by the blockwise
core where the run's cannot compute the layer: `AttentionCore.serving`). Gemma 4's layers take their
values from the key projection (`values_from_keys`), normalise each value head without a weight
(`value_norm`), and share keys and values between layers (`kv_sharing`): a storing layer hands its
normalised, rotated keys and its values on, a reusing one has no projections for them and attends with
those (`blocks/carried.py` carries them between layers and pipeline stages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import paddle
import paddle.nn.functional as F

from modeling.attention_core import AttentionCore, Heads
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.blocks.norms import rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Declared, Leaf, Norm, Part, RowLinear
from modeling.blocks.rotary import Rotary
from modeling.execution import Execution
from modeling.placement import A_LOG, ONES, VECTOR_SPLIT, ZEROS, Placement, TensorPlan
from modeling.sequence_parallel import gather_tokens

HEAD_NORM, PROJECTION_NORM = "head", "projection"  # q/k norms over each head, or over the whole projection
L2_NORM = "l2"  # each rotated q and k head over its root mean square, no weight (Llama 4's rotary layers)
STORE_KV, REUSE_KV = "store", "reuse"  # transformers' kv_sharing_modes: hands its keys and values on, attends with another's


def l2_norm(x: paddle.Tensor, eps: float) -> paddle.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in fp32 (transformers' Llama4TextL2Norm)."""
    wide = x.astype("float32")
    return (wide * paddle.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).astype(x.dtype)


@dataclass(frozen=True)
class QueryTemperature:
    """Queries scaled by their position p so long contexts sharpen the softmax: 1 + scale x log(1 +
    floor((p + offset) / floor)) (Llama 4's NoPE layers: attn_scale, floor_scale, offset 1; Mistral 4's
    latent attention: llama_4_scaling_beta, original_max_position_embeddings, offset 0)."""

    scale: float
    floor: float
    offset: int = 0

    def scales(self, positions: paddle.Tensor) -> paddle.Tensor:
        return paddle.log1p(paddle.floor((positions.astype("float32") + self.offset) / self.floor)) * self.scale + 1.0

    def apply(self, q: paddle.Tensor, run: Execution, positions: paddle.Tensor | None) -> paddle.Tensor:
        """`q` [batch, local, heads, d] (or [local, batch, ...] under SP) scaled at its queries' positions: in
        their documents when per-document, else their sequence positions (under context parallelism not
        0..n-1)."""
        if positions is None:
            local = q.shape[0 if run.sequence_first else 1]
            held = run.positions(local)
            positions = paddle.to_tensor(np.arange(local) if held is None else held).unsqueeze(0)
        scales = self.scales(positions)  # [batch or 1, local]
        scales = scales.transpose([1, 0]) if run.sequence_first else scales
        return q * scales.unsqueeze(-1).unsqueeze(-1).astype(q.dtype)


@dataclass(frozen=True)
class HeadVector(Leaf):
    """One parameter per head (sink logits; a recurrent mixer's decay rate and time-step bias), split
    over tp with the heads; a parameter of its block under the part's own name (transformers'
    `self_attn.sinks`, `linear_attn.A_log`), starting as `init` says. `unit_axes` (before, after):
    axes of size 1 around the heads, as a family stores them (Kimi Linear's A_log: [1, 1, heads, 1])."""

    heads: int
    init: str = ZEROS
    unit_axes: tuple[int, int] = (0, 0)

    def tensors(self) -> dict[str, TensorPlan]:
        before, after = self.unit_axes
        return {"": TensorPlan((1,) * before + (self.heads,) + (1,) * after, Placement(VECTOR_SPLIT + before),
                               init=self.init)}

    def build(self, config, run: Execution):
        """Drawn from Paddle's generator (`paddle.seed` makes a model's build repeatable); a trainer
        run sets every tensor from its plan afterwards (`init_single_card_weights`)."""
        before, after = self.unit_axes
        shape = [1] * before + [self.heads // run.tp] + [1] * after
        if self.init == A_LOG:
            param = paddle.create_parameter(shape, "float32", default_initializer=paddle.nn.initializer.Uniform(0.01, 16.0))
            param.set_value(paddle.log(param))
        else:
            param = paddle.create_parameter(shape, "float32", default_initializer=paddle.nn.initializer.Constant(
                1.0 if self.init == ONES else 0.0))
        if run.tp > 1:
            param.is_distributed, param.split_axis = True, before
        return param


@dataclass(frozen=True)
class Attention(Declared):
    """One layer's attention. `qk_norm`: HEAD_NORM, PROJECTION_NORM or None, with `norm` the norm
    used (its eps and form; its dim is set per place), under the names `qk_norm_names`; per-head norms
    apply before the rotary, or after it (`qk_norm_after_rotary`: Hunyuan's); L2_NORM has no weight and
    applies after the rotary. `temperature` scales each query by its position."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: head_dim
    qkv_bias: bool = False
    o_bias: bool = False
    output: str = "o_proj"
    qk_norm: str | None = None
    norm: Norm | None = None
    spec: CoreSpec = PLAIN
    rotary: Rotary | None = None
    sinks: bool = False
    clip_qkv: float | None = None
    output_gate: bool = False  # q_proj also emits a gate per head (after each head's q); out * sigmoid(gate)
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    qk_norm_after_rotary: bool = False
    temperature: QueryTemperature | None = None  # Llama 4's query scales by position
    values_from_keys: bool = False  # Gemma 4's attention_k_eq_v: no v_proj, values are k_proj's output
    value_norm: bool = False  # each value head over its root mean square, no weight (Gemma 4's v_norm)
    kv_sharing: str | None = None  # STORE_KV, REUSE_KV or None
    kv_unit: str = "num_key_value_heads"  # the config field its key/value heads are (Gemma 4's full layers: another)
    recurrent: ClassVar[bool] = False  # a token mixer with an attention core (a recurrent one: blocks/gated_delta.py)

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def reuses_kv(self) -> bool:
        return self.kv_sharing == REUSE_KV

    def parts(self) -> dict[str, Part]:
        q_width, k_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        parts: dict[str, Part] = {
            "q_proj": ColumnLinear(self.hidden, q_width * (2 if self.output_gate else 1), self.qkv_bias)}
        if not self.reuses_kv:
            parts["k_proj"] = ColumnLinear(self.hidden, k_width, self.qkv_bias, self.kv_heads)
            if not self.values_from_keys:
                parts["v_proj"] = ColumnLinear(self.hidden, self.kv_heads * self.v_dim, self.qkv_bias, self.kv_heads)
        parts[self.output] = RowLinear(self.heads * self.v_dim, self.hidden, self.o_bias)
        q_norm, k_norm = self.qk_norm_names
        if self.qk_norm == HEAD_NORM:
            head = Norm(self.head_dim, self.norm.eps, self.norm.offset, per_head=True)
            parts |= {q_norm: head} | ({} if self.reuses_kv else {k_norm: head})
        elif self.qk_norm == PROJECTION_NORM:
            parts |= {q_norm: Norm(q_width, self.norm.eps, split=True), k_norm: Norm(k_width, self.norm.eps, split=True)}
        if self.sinks:
            parts["sinks"] = HeadVector(self.heads)
        return parts

    def own_tp_units(self) -> dict[str, int]:
        """The query heads split over tp; the key/value heads too when a k norm spans the whole projection
        (its statistics need every head a rank holds, and a rank holding them all would normalise other
        ranks' heads)."""
        units = {"num_attention_heads": self.heads}
        return units | ({"num_key_value_heads": self.kv_heads} if self.qk_norm == PROJECTION_NORM else {})

    def own_tp_shared_units(self) -> dict[str, int]:
        """Key/value heads: split over tp, or with fewer heads than tp ranks each rank holds the projections
        whole and attends with its queries' head (`kv_slot`)."""
        return {} if self.qk_norm == PROJECTION_NORM else {self.kv_unit: self.kv_heads}

    def local_heads(self, run: Execution) -> Heads:
        return Heads(self.heads // run.tp, max(self.kv_heads // run.tp, 1), self.head_dim, self.v_dim)

    def kv_slot(self, run: Execution) -> int | None:
        """With more tp ranks than key/value heads: the head this rank's queries use (its queries are a
        contiguous 1/tp of the heads, inside one group of heads / kv_heads); None when tp splits them."""
        return run.tp_rank * self.kv_heads // run.tp if run.tp > self.kv_heads else None

    def core(self, run: Execution) -> AttentionCore:
        """The core computing this layer in `run` (the run's, or blockwise where it cannot)."""
        return run.attention.serving(self.spec, self.sinks, self.local_heads(run))

    def core_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int, int]:
        """(what the core keeps, its inputs q, k and v, its output) in bytes on this tp rank."""
        heads = self.local_heads(run)
        kept = self.core(run).saved_bytes(batch, seq_len, heads, dtype_bytes, run.sequence_first,
                                          run.spec_for(self.spec.local(self.heads, run.tp, run.tp_rank)), self.sinks)
        return kept, heads.qkv_bytes(batch * seq_len, dtype_bytes), heads.output_bytes(batch * seq_len, dtype_bytes)

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward, by its sublayers' names ("" for its own code): q, k and v
        share one saved input, full-size with or without SP; the core keeps what its own model says,
        and the output projection its input unless the core already keeps that tensor; the rotary
        tables as `Rotary.kept_bytes` says. Clipping q, k and v (MPT) keeps them unclipped for its
        gradient's mask. A gated output keeps the gate's sigmoid and the core's output, and the output
        projection the gated product."""
        tokens, heads = batch * seq_len, self.local_heads(run)
        kept, qkv, output = self.core_bytes(run, batch, seq_len, dtype_bytes)
        rotary = self.rotary.kept_bytes(batch, seq_len, dtype_bytes, run.documents is not None) if self.rotary else 0
        clipped = qkv if self.clip_qkv is not None else 0  # the clip keeps q, k and v as they were
        keeps_output = self.core(run).keeps_output(run.sequence_first)
        saved = {"q_proj": tokens * self.hidden * dtype_bytes, "": kept + rotary + clipped,
                 self.output: 0 if keeps_output and not self.output_gate else output}
        if self.output_gate:  # sigmoid(gate), and the core's output unless the core keeps it
            saved[""] += tokens * heads.heads * self.head_dim * dtype_bytes + (0 if keeps_output else output)
        q_norm, k_norm = self.qk_norm_names
        if self.qk_norm == L2_NORM:  # each keeps its fp32 input and 1/rms per vector
            vectors = tokens * (heads.heads + heads.kv_heads)
            saved[""] += vectors * self.head_dim * max(dtype_bytes, 4) + vectors * 4
        if self.value_norm and not self.reuses_kv:  # the same for each value head; in fp32 its input is the
            # k norm's when values are the key projection's output (one tensor)
            shares_input = self.values_from_keys and self.qk_norm == HEAD_NORM and dtype_bytes >= 4
            saved[""] += tokens * heads.kv_heads * ((0 if shares_input else self.v_dim * max(dtype_bytes, 4)) + 4)
        if self.temperature is not None:  # the product keeps the rotated queries
            saved[""] += tokens * heads.heads * self.head_dim * dtype_bytes
        if self.qk_norm == HEAD_NORM:
            saved[q_norm] = rms_norm_saved_bytes(tokens, self.head_dim, dtype_bytes, self.norm.offset, heads.heads)
            if not self.reuses_kv:
                saved[k_norm] = rms_norm_saved_bytes(tokens, self.head_dim, dtype_bytes, self.norm.offset,
                                                     heads.kv_heads)
        elif self.qk_norm == PROJECTION_NORM:
            saved |= {q_norm: rms_norm_saved_bytes(tokens, heads.heads * self.head_dim, dtype_bytes, False),
                      k_norm: rms_norm_saved_bytes(tokens, heads.kv_heads * self.head_dim, dtype_bytes, False)}
        return saved


class SelfAttention(Block):
    def __init__(self, config, run: Execution, declared: Attention):
        super().__init__(config, run, declared)
        self.heads = declared.local_heads(run)
        self.spec = run.spec_for(declared.spec.local(declared.heads, run.tp, run.tp_rank))
        self.attend = declared.core(run)

    def forward(self, hidden, positions=None, shared=None):
        """`positions`: each token's position in its document under per-document attention, else None.
        `shared`: the (keys, values) a layer reusing another's attends with. A storing layer returns
        (output, keys, values), the others the output."""
        declared, run, heads = self.declared, self.run, self.heads
        hidden = gather_tokens(hidden, run)
        seq_first = run.sequence_first
        lead = hidden.shape[:2]  # [batch, seq], or [seq, batch] under sequence parallelism
        q = self.q_proj(hidden)
        if shared is None:
            k = self.k_proj(hidden)
            v = k if declared.values_from_keys else self.v_proj(hidden)
        if declared.clip_qkv is not None:
            q, k, v = (paddle.clip(t, -declared.clip_qkv, declared.clip_qkv) for t in (q, k, v))
        q_norm, k_norm = (getattr(self, name, None) for name in declared.qk_norm_names) \
            if declared.qk_norm in (HEAD_NORM, PROJECTION_NORM) else (None, None)
        if declared.qk_norm == PROJECTION_NORM:
            q, k = q_norm(q), k_norm(k)
        if declared.output_gate:  # per head: its q, then its gate (Qwen3.5's and Qwen3-Next's full layers)
            q, gate = paddle.split(q.reshape(lead + [heads.heads, 2 * heads.qk_dim]), 2, axis=-1)
        q = q.reshape(lead + [heads.heads, heads.qk_dim])
        if shared is None:
            k, v = self._keys_values(k, v, lead, k_norm)
        if declared.qk_norm == HEAD_NORM and not declared.qk_norm_after_rotary:
            q = q_norm(q)
        if declared.rotary is not None:
            q, k = declared.rotary.rotate(q, None if shared else k, seq_first, run.kernels.fused_rope, run.cp,
                                          positions)
        if declared.qk_norm == HEAD_NORM and declared.qk_norm_after_rotary:
            q, k = q_norm(q), k_norm(k)
        elif declared.qk_norm == L2_NORM:
            q, k = l2_norm(q, declared.norm.eps), l2_norm(k, declared.norm.eps)
        k, v = shared if shared else (k, v)
        batch_local = (lead[1], lead[0]) if seq_first else (lead[0], lead[1])
        if declared.temperature is not None:
            q = declared.temperature.apply(q, run, positions)
        sinks = self.sinks if declared.sinks else None
        documents = run.documents_at(positions, self.spec, batch_local)
        out = run.recompute("core_attn", lambda *qkv: self.attend(*qkv, seq_first, self.spec, sinks, documents),
                            q, k, v, training=self.training)
        if declared.output_gate:
            out = out * F.sigmoid(gate.reshape(out.shape))
        out = getattr(self, declared.output)(out)
        return (out, k, v) if declared.kv_sharing == STORE_KV else out

    def _keys_values(self, k, v, lead: list[int], k_norm):
        """This rank's key and value heads from their projections' outputs: its queries' head when the
        projections are whole (more tp ranks than heads), the keys normalised per head before the
        rotary where the family does, the values per head where it does (Gemma 4's v_norm)."""
        declared, heads = self.declared, self.heads
        slot = declared.kv_slot(self.run)
        if slot is not None:  # the projections are whole: this rank's queries use one of their heads
            k = k.reshape(lead + [declared.kv_heads, heads.qk_dim])[..., slot:slot + 1, :]
            v = v.reshape(lead + [declared.kv_heads, heads.v_dim])[..., slot:slot + 1, :]
        k = k.reshape(lead + [heads.kv_heads, heads.qk_dim])
        v = v.reshape(lead + [heads.kv_heads, heads.v_dim])
        if declared.qk_norm == HEAD_NORM and not declared.qk_norm_after_rotary:
            k = k_norm(k)
        if declared.value_norm:
            v = l2_norm(v, declared.norm.eps)
        return k, v


Attention.layer = SelfAttention
