"""Gated DeltaNet (Qwen3.5, Qwen3-Next, Olmo-Hybrid) and Kimi Delta Attention (Kimi Linear): token mixers
with a d_k x d_v state per value head in place of attention (`GatedDelta`, built as `GatedDeltaMixer`;
`KimiDelta`, its decay per key channel and its gate through low-rank projections, as `KimiDeltaMixer`).

    q, k, v = silu(causal depthwise conv(in_proj_q/k/v(x)))        (kernel `conv_kernel`, no bias)
    q, k = l2norm(q), l2norm(k); q = q d_k^-1/2
    beta = beta_scale sigmoid(in_proj_b(x)); g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)   (per value head)
    o = the gated delta rule (the run's `recurrent_core.RecurrentCore`) on q, k, v, g, beta
    out_proj(RMSNorm_dv(o) * silu(in_proj_z(x)))                      (the norm's weight over d_v)

Qwen3.5's folders store q, k and v's projection fused (`in_proj_qkv`: q's rows, k's, v's) and their conv
likewise (`conv1d`, channels q | k | v; Olmo-Hybrid's and Kimi Linear's store each apart, under the
names `SEPARATE_NAMES` gives); ours are separate, so tp splits each by its heads (key heads
for q and k, value heads for v, z, a, b, `A_log`, `dt_bias` and out_proj's rows) and the family's
adapter reads and writes the fused tensors. A value head reads key head h // (value heads / key
heads): contiguous shares of both keep each rank's pairs together when tp divides the key heads.
The gated norm's weight is per head dimension, whole on every rank, its gradient summed over tp.

Packed documents (`Execution.within_documents`): the conv window and the state restart at every
document, as if each were run alone (`recurrent_core` masks the decays; the conv masks the earlier
document's taps). Sequence parallelism gathers the sequence before the mixer as attention does;
context parallelism runs the conv and the rule on each of the rank's two parts from what the parts
before them leave (`recurrent_cp`: the conv's last inputs and the rule's state, no keys or values).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import paddle
import paddle.nn.functional as F
from paddle import nn

from modeling.blocks.attention import HeadVector
from modeling.blocks.norms import FP32_BYTES, rms_norm_saved_bytes
from modeling.blocks.parts import Block, ColumnLinear, Declared, Leaf, Norm, Part, RowLinear, WholeLinear
from modeling.execution import Execution
from modeling.placement import A_LOG, ONES, VECTOR_SPLIT, ZEROS, Placement, TensorPlan
from modeling.recurrent_core import document_ids
from modeling.recurrent_cp import conv_by_parts, rule_across_parts
from modeling.sequence_parallel import gather_tokens

if TYPE_CHECKING:
    from modeling.transformers_adapter import Stored

L2_EPS = 1e-6  # transformers' (and fla's) l2norm inside the rule
# transformers' names of the mixer's parts in the families that store each projection and conv apart
# (Olmo-Hybrid, Kimi Linear), ours -> theirs; the rest (A_log, dt_bias, f_a_proj...) are named alike
SEPARATE_NAMES = {"in_proj_q": "q_proj", "in_proj_k": "k_proj", "in_proj_v": "v_proj", "in_proj_z": "g_proj",
                  "in_proj_a": "a_proj", "in_proj_b": "b_proj", "out_proj": "o_proj", "norm": "o_norm",
                  "conv_q": "q_conv1d", "conv_k": "k_conv1d", "conv_v": "v_conv1d"}


def stored_apart(stored: Stored, mixer: str) -> Stored:
    """Where such a family stores one of our tensors: a part of the mixer (a decoder layer's `mixer`
    block) under its name in `SEPARATE_NAMES`, anything else where `stored` says (no attention block
    has a part of those names)."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if part in SEPARATE_NAMES and prefix.endswith(f".{mixer}"):
        return replace(stored, name=f"{prefix}.{SEPARATE_NAMES[part]}.{param}")
    return stored


@dataclass(frozen=True)
class CausalConv(Leaf):
    """A depthwise causal conv1d over `channels` (weight [channels, 1, kernel] as torch's Conv1d with
    groups = channels; a bias per channel with `bias`, Mamba-2's), channels split over tp with their
    heads."""

    channels: int
    kernel: int
    bias: bool = False

    def tensors(self) -> dict[str, TensorPlan]:
        weight = {"weight": TensorPlan((self.channels, 1, self.kernel), Placement(VECTOR_SPLIT))}
        return weight | ({"bias": TensorPlan((self.channels,), Placement(VECTOR_SPLIT), init=ZEROS)} if self.bias else {})

    def build(self, config, run: Execution) -> nn.Layer:
        return DepthwiseCausalConv(self.channels // run.tp, self.kernel, distributed=run.tp > 1, bias=self.bias)


class DepthwiseCausalConv(nn.Layer):
    """y[t] = sum_s w[:, K-1-s] x[t-s] over the taps s that stay in the token's document (K shifted
    products: a document's first tokens see zeros before them, as a run of that document alone
    would; token t - s is in t's document when t's position in it is at least s). `halo`: the K-1
    rows before x (the previous part's, under context parallelism), zeros when None."""

    def __init__(self, channels: int, kernel: int, distributed: bool, bias: bool = False):
        super().__init__()
        self.weight = self.create_parameter([channels, 1, kernel])
        self.bias = self.create_parameter([channels], is_bias=True) if bias else None
        for param in (self.weight, self.bias):
            if distributed and param is not None:
                param.is_distributed, param.split_axis = True, 0

    def forward(self, x, positions=None, halo=None):
        """x [batch, seq, channels]; `positions` [batch, seq] each token's position in its document, or None."""
        kernel, length = self.weight.shape[-1], x.shape[1]
        taps = self.weight.squeeze(1)  # [channels, kernel]
        out = x * taps[:, kernel - 1]
        for shift in range(1, kernel if halo is not None else min(kernel, length)):
            if halo is None:
                earlier = F.pad(x[:, :length - shift], [shift, 0], data_format="NLC")
            elif shift < length:
                earlier = paddle.concat([halo[:, kernel - 1 - shift:], x[:, :length - shift]], axis=1)
            else:  # x shorter than the tap (a generated token): every earlier input is the halo's
                earlier = halo[:, kernel - 1 - shift:kernel - 1 - shift + length]
            if positions is not None:
                earlier = earlier * (positions >= shift).astype(x.dtype).unsqueeze(-1)
            out = out + earlier * taps[:, kernel - 1 - shift]
        return out if self.bias is None else out + self.bias


def conv_saved_bytes(run: Execution, tokens: int, kernel: int, dtype_bytes: int, channels: int) -> int:
    """What a `DepthwiseCausalConv` over `channels` keeps for backward: its input and each earlier tap's
    shifted copy; with packed documents each tap's mask and masked copy too."""
    documents, taps = run.documents is not None and run.within_documents, kernel - 1
    copies = 1 + taps * (2 if documents else 1)
    return (tokens * channels * copies + (tokens * taps if documents else 0)) * dtype_bytes


def convolver(run: Execution, positions):
    """conv(layer, x): a `DepthwiseCausalConv` on x [batch, seq, channels] as the run needs it: on the
    whole sequence, or under context parallelism on each of the rank's parts after the part before."""
    if run.ring is None:
        return lambda conv, x: conv(x, positions)
    return lambda conv, x: conv_by_parts(conv, x, positions, run.ring)


@dataclass(frozen=True)
class GatedDelta(Declared):
    """One layer's Gated DeltaNet: `key_heads` q/k heads of `key_dim`, `value_heads` value heads of
    `value_dim`, the conv's `conv_kernel`, the gated norm's `eps`; `beta_scale` 2 lets the write
    strength reach 2, so the rule's transition I - beta k k^T has eigenvalues down to -1 (Olmo-Hybrid's
    `linear_allow_neg_eigval`)."""

    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float
    beta_scale: float = 1.0
    recurrent: ClassVar[bool] = True  # no attention core: core_attn recompute leaves the layer as it is
    channel_decay: ClassVar[bool] = False  # a decay per value head (Kimi Delta's: per key channel)

    def parts(self) -> dict[str, Part]:
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return {
            "in_proj_q": ColumnLinear(self.hidden, keys), "in_proj_k": ColumnLinear(self.hidden, keys),
            "in_proj_v": ColumnLinear(self.hidden, values), "in_proj_z": ColumnLinear(self.hidden, values),
            "in_proj_b": ColumnLinear(self.hidden, self.value_heads),
            "in_proj_a": ColumnLinear(self.hidden, self.value_heads),
            "conv_q": CausalConv(keys, self.conv_kernel), "conv_k": CausalConv(keys, self.conv_kernel),
            "conv_v": CausalConv(values, self.conv_kernel),
            "A_log": HeadVector(self.value_heads, A_LOG), "dt_bias": HeadVector(self.value_heads, ONES),
            "norm": Norm(self.value_dim, self.eps, per_head=True),
            "out_proj": RowLinear(values, self.hidden),
        }

    def own_tp_units(self) -> dict[str, int]:
        return {"linear_num_key_heads": self.key_heads, "linear_num_value_heads": self.value_heads}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward on a tp rank, by sublayer ("" for its own code), as the
        layer of `Decoder` reads it (equal to the measured bytes in fp32: tests/test_family_activations.py).
        Per token, over this rank's K key and V value channels and its key and value heads: the
        projections' shared input (whole under SP: the mixer gathers it); each conv its input and
        each earlier tap's shifted copy (with documents each tap's mask and masked copy too); the
        convs' outputs (SiLU's inputs); q's and k's l2norm
        inputs and their inverse norms; what the rule keeps (`RecurrentCore.kept_bytes`: its inputs
        q, k, v, g, beta, the document ids and a state per span); the decay's softplus input and
        output (fp32); the gate (SiLU's input); the gated product's two factors; the norm's and
        out_proj's inputs. Under context parallelism the summary runs keep more (not modelled yet)."""
        tokens, tp = batch * seq_len, run.tp
        keys, values = self.key_heads * self.key_dim // tp, self.value_heads * self.value_dim // tp
        key_heads, value_heads = self.key_heads // tp, self.value_heads // tp
        conv = partial(conv_saved_bytes, run, tokens, self.conv_kernel, dtype_bytes)

        own = tokens * (2 * keys + values) * dtype_bytes  # the convs' outputs
        own += 2 * tokens * (keys + key_heads) * dtype_bytes  # l2norm of q and of k
        decay_width = self.key_dim if self.channel_decay else 1
        own += run.recurrent.kept_bytes(batch, seq_len, key_heads, value_heads, self.key_dim, self.value_dim,
                                        dtype_bytes, decay_width)
        own += 2 * tokens * value_heads * decay_width * FP32_BYTES  # softplus's input and output
        own += 2 * value_heads * FP32_BYTES  # exp(A_log) and its negation
        own += 3 * tokens * values * dtype_bytes  # the gate, and the gated product's factors
        if self.beta_scale != 1.0:  # sigmoid keeps its output, the rule the scaled copy
            own += tokens * value_heads * dtype_bytes
        return {"in_proj_q": tokens * self.hidden * dtype_bytes, "conv_q": conv(keys), "conv_k": conv(keys),
                "conv_v": conv(values), "": own,
                "norm": rms_norm_saved_bytes(tokens, self.value_dim, dtype_bytes, False, value_heads),
                "out_proj": tokens * values * dtype_bytes}


@dataclass
class Carry:
    """What a recurrent mixer carries from one call to the next when text is generated token by token
    (`paddle_pp/training/decoding.py`): each conv's last kernel - 1 inputs, and the rule's state."""

    conv: dict = field(default_factory=dict)
    state: paddle.Tensor | None = None


class RecurrentMixer(Block):
    """What every recurrent token mixer does around its own arithmetic: the whole sequences in
    [batch, seq, hidden] (gathered under SP), the convs on the projections (each part after the part
    before under context parallelism), the run's rule (across the cp group's parts), and out_proj in
    the run's layout. With a `Carry` (generation, one process) the convs and the rule start where the
    previous call left off, and leave it for the next."""

    def whole_sequences(self, hidden, positions):
        """(hidden [batch, seq, hidden], `positions` under per-document training, else None: one stream)."""
        hidden = gather_tokens(hidden, self.run)
        if self.run.sequence_first:  # [seq, batch, hidden] -> [batch, seq, hidden]
            hidden = hidden.transpose([1, 0, 2])
        return hidden, positions if self.run.within_documents else None

    def convolved(self, hidden, names: str, positions, carry: Carry | None = None) -> list:
        """silu(conv_n(in_proj_n(hidden))) for each n of `names` (its projection as `projected` gives it)."""
        if carry is None:
            convolve = convolver(self.run, positions)
            return [F.silu(convolve(getattr(self, f"conv_{name}"), self.projected(name, hidden))) for name in names]
        out = []
        for name in names:
            conv, x = getattr(self, f"conv_{name}"), self.projected(name, hidden)
            taps, halo = conv.weight.shape[-1] - 1, carry.conv.get(name)
            out.append(F.silu(conv(x, None, halo)))
            inputs = x if halo is None else paddle.concat([halo, x], axis=1)
            carry.conv[name] = F.pad(inputs, [max(taps - inputs.shape[1], 0), 0], data_format="NLC")[:, -taps:]
        return out

    def projected(self, name: str, hidden):
        return getattr(self, f"in_proj_{name}")(hidden)

    def rule(self, q, k, v, g, beta, positions, carry: Carry | None = None):
        run = self.run
        if carry is not None:
            out, carry.state = run.recurrent(q, k, v, g, beta, initial_state=carry.state)
            return out
        if run.ring is None:
            return run.recurrent(q, k, v, g, beta, segments=None if positions is None else document_ids(positions))[0]
        return rule_across_parts(run.recurrent, q, k, v, g, beta, positions, run.ring)

    def projected_out(self, out):
        """out_proj of out [batch, seq, channels], in the run's layout."""
        return self.out_proj(out.transpose([1, 0, 2]) if self.run.sequence_first else out)


class GatedDeltaMixer(RecurrentMixer):
    def forward(self, hidden, positions=None, carry: Carry | None = None):
        """`positions`: each token's position in its document under per-document training, else None."""
        declared = self.declared
        hidden, positions = self.whole_sequences(hidden, positions)
        batch, length = hidden.shape[:2]
        q, k, v = self.convolved(hidden, "qkv", positions, carry)
        q, k = (_l2norm(x.reshape([batch, length, -1, declared.key_dim])) for x in (q, k))
        v = v.reshape([batch, length, -1, declared.value_dim])
        beta = F.sigmoid(self.in_proj_b(hidden))
        if declared.beta_scale != 1.0:
            beta = beta * declared.beta_scale
        out = self.rule(q * declared.key_dim ** -0.5, k, v, self.decay(hidden), beta, positions, carry)
        gate = self.output_gate(hidden).reshape([batch, length, -1, declared.value_dim])
        return self.projected_out((self.norm(out.astype(hidden.dtype)) * self.gated(gate)).reshape([batch, length, -1]))

    def decay(self, hidden):
        """g [batch, seq, value heads] (fp32): -exp(A_log) softplus(in_proj_a(x) + dt_bias)."""
        return -paddle.exp(self.A_log.astype("float32")) * F.softplus(self.in_proj_a(hidden).astype("float32")
                                                                       + self.dt_bias)

    def output_gate(self, hidden):
        return self.in_proj_z(hidden)

    gated = staticmethod(F.silu)  # the gated norm's activation of the output gate


@dataclass(frozen=True)
class KimiDelta(GatedDelta):
    """One layer's Kimi Delta Attention (Kimi Linear): Gated DeltaNet with a decay per key channel,
    g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias) (a rank-`key_dim` projection; `dt_bias` per
    channel, `A_log` per head, stored [1, 1, heads, 1]), an output gate through a rank-`key_dim`
    projection (g_a, g_b) and a sigmoid in the gated norm; as many key heads as value heads, of one
    size. The low-rank inputs (f_a, g_a) stay whole on every tp rank, as latent attention's do."""

    channel_decay: ClassVar[bool] = True

    def parts(self) -> dict[str, Part]:
        channels = self.key_heads * self.key_dim
        parts = {name: part for name, part in super().parts().items() if name not in ("in_proj_a", "in_proj_z")}
        return {**parts, "f_a_proj": WholeLinear(self.hidden, self.key_dim),
                "f_b_proj": ColumnLinear(self.key_dim, channels),
                "g_a_proj": WholeLinear(self.hidden, self.key_dim),
                "g_b_proj": ColumnLinear(self.key_dim, self.value_heads * self.value_dim),
                "A_log": HeadVector(self.value_heads, A_LOG, unit_axes=(2, 1)), "dt_bias": HeadVector(channels, ONES)}

    def own_tp_units(self) -> dict[str, int]:
        return {"linear_num_heads": self.key_heads}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """Gated DeltaNet's (its decays per key channel), with the low-rank projections' inputs (f_b's
        and g_b's), and the sigmoid gate keeping only its output (the gated product's factor)."""
        saved = super().saved_bytes(run, batch, seq_len, dtype_bytes)
        tokens, values = batch * seq_len, self.value_heads * self.value_dim // run.tp
        saved[""] -= tokens * values * dtype_bytes
        return saved | {"f_b_proj": tokens * self.key_dim * dtype_bytes, "g_b_proj": tokens * self.key_dim * dtype_bytes}


class KimiDeltaMixer(GatedDeltaMixer):
    def decay(self, hidden):
        """g [batch, seq, heads, key_dim] (fp32): a decay per key channel."""
        declared = self.declared
        rates = paddle.exp(self.A_log.astype("float32")).reshape([1, 1, -1, 1])
        forget = (self.f_b_proj(self.f_a_proj(hidden)).astype("float32") + self.dt_bias).reshape(
            hidden.shape[:2] + [-1, declared.key_dim])
        return -rates * F.softplus(forget)

    def output_gate(self, hidden):
        return self.g_b_proj(self.g_a_proj(hidden))

    gated = staticmethod(F.sigmoid)


def _l2norm(x):
    return x * paddle.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


GatedDelta.layer = GatedDeltaMixer
KimiDelta.layer = KimiDeltaMixer
