"""Mamba-2 (Nemotron-H / Nemotron 3): a token mixer with a state of d_state x head_dim per head, the
recurrent core's rule without its delta term (`Mamba2`, built as `Mamba2Mixer`).

    x, B, C = silu(causal depthwise conv(in_proj_x/B/C(h)) + conv bias)   (x per head, B and C per group)
    dt = clip(softplus(in_proj_dt(h) + dt_bias), dt_limit); A = -exp(A_log)   (per head, fp32)
    y = the rule (the run's `recurrent_core.RecurrentCore`) on q = C, k = B, v = dt x, g = dt A; + D x
    out_proj(GroupRMSNorm(y * silu(in_proj_z(h))))           (normalised per group of heads, then scaled)

Falcon-H1's variant (its fields' defaults leave the above): h times `in_multiplier` before the
projections, each projection's output times its `multipliers` entry (z, x, B, C, dt: its muP vector),
and the gated norm per `gated_norm`: the gate then the norm (GATE_THEN_NORM, the above), the norm then
the gate (NORM_THEN_GATE), or no norm (None: out_proj(y * silu(z))).

A head reads its group's B and C (head h: group h // (heads / groups)), so the rule's key heads are the
groups, its d_k the state size. transformers' folders store the five projections fused (`in_proj`: z's
rows, x's, B's, C's, dt's) and the three convs likewise (`conv1d`, channels x | B | C, with a bias);
ours are separate, so tp splits each by its heads or groups (whole groups per rank, each rank's heads
those of its groups) and the family's adapter reads and writes the fused tensors. The gated norm's
weight spans every head's channels: split with them.

Each family says where dt is clamped (transformers 5: Nemotron-H below at `time_step_min`, Bamba's and
Granite 4.0-H's mixers to the config's `time_step_limit`). Packed documents, sequence and
context parallelism are the Gated DeltaNet mixer's (`gated_delta`): the conv window and the state restart
at each document, and under context parallelism each part runs from the conv inputs and the state the
parts before leave.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

import paddle
import paddle.nn.functional as F

from modeling.blocks.attention import HeadVector
from modeling.blocks.gated_delta import Carry, CausalConv, RecurrentMixer, conv_saved_bytes
from modeling.blocks.norms import FP32_BYTES, rms_norm_saved_bytes
from modeling.blocks.parts import ColumnLinear, Declared, Norm, Part, RowLinear
from modeling.execution import Execution
from modeling.placement import A_LOG, ONES
from modeling.transformers_adapter import Stored

IN_PROJ = ("in_proj_z", "in_proj_x", "in_proj_B", "in_proj_C", "in_proj_dt")  # transformers' fused in_proj, in order
GATE_THEN_NORM, NORM_THEN_GATE = "gate_then_norm", "norm_then_gate"  # where the gated norm gates
CONV = ("conv_x", "conv_B", "conv_C")  # its fused conv1d's channels, in order


@dataclass(frozen=True)
class Mamba2(Declared):
    """One layer's Mamba-2: `heads` heads of `head_dim`, B and C in `groups` groups of `state_size`,
    the conv's `conv_kernel` (with a bias: `conv_bias`), the input projections' `bias` and out_proj's
    `out_bias`, the gated norm's `eps` and order (`gated_norm`), dt clamped to `dt_limit` (min, max);
    Falcon-H1's multipliers (module doc)."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int
    eps: float
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    bias: bool = False
    out_bias: bool = False
    gated_norm: str | None = GATE_THEN_NORM
    in_multiplier: float = 1.0
    multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    recurrent: ClassVar[bool] = True  # no attention core: core_attn recompute leaves the layer as it is

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def parts(self) -> dict[str, Part]:
        inner, states = self.inner, self.groups * self.state_size
        return {
            "in_proj_z": ColumnLinear(self.hidden, inner, self.bias),
            "in_proj_x": ColumnLinear(self.hidden, inner, self.bias),
            "in_proj_B": ColumnLinear(self.hidden, states, self.bias),
            "in_proj_C": ColumnLinear(self.hidden, states, self.bias),
            "in_proj_dt": ColumnLinear(self.hidden, self.heads, self.bias),
            "conv_x": CausalConv(inner, self.conv_kernel, self.conv_bias),
            "conv_B": CausalConv(states, self.conv_kernel, self.conv_bias),
            "conv_C": CausalConv(states, self.conv_kernel, self.conv_bias),
            "A_log": HeadVector(self.heads, A_LOG), "dt_bias": HeadVector(self.heads, ONES),
            "D": HeadVector(self.heads, ONES),
            **({"norm": Norm(inner, self.eps, group_size=inner // self.groups)} if self.gated_norm else {}),
            "out_proj": RowLinear(inner, self.hidden, self.out_bias),
        }

    def own_tp_units(self) -> dict[str, int]:
        return {"n_groups": self.groups, "mamba_num_heads": self.heads}

    def saved_bytes(self, run: Execution, batch: int, seq_len: int, dtype_bytes: int) -> dict[str, int]:
        """What one call keeps for backward on a tp rank, by sublayer ("" for its own code), as the
        layer of `Decoder` reads it. Per token, over this rank's X head channels, S = groups x
        state channels and H heads: the projections' shared input (whole under SP); each conv its input
        and each earlier tap's shifted copy (with documents each tap's mask and masked copy too); the
        convs' outputs (SiLU's inputs); dt's softplus input and output and its clamp's output dt (fp32);
        x, which v = x dt and D x both keep (dt is kept already, D is a parameter); what the rule keeps
        (its inputs, document ids and a state per span); -exp(A_log) and exp's output; the gate (SiLU's
        input), the gated product's factors (with the norm first, the norm's output in place of y); the
        norm's and out_proj's inputs. The multipliers are scale ops: they keep nothing."""
        tokens, tp = batch * seq_len, run.tp
        inner, states, heads = self.inner // tp, self.groups * self.state_size // tp, self.heads // tp
        conv = partial(conv_saved_bytes, run, tokens, self.conv_kernel, dtype_bytes)

        own = tokens * (inner + 2 * states) * dtype_bytes  # the convs' outputs
        own += 3 * tokens * heads * FP32_BYTES  # softplus's input and output, the clamp's output
        own += tokens * inner * dtype_bytes  # x
        own += run.recurrent.kept_bytes(batch, seq_len, self.groups // tp, heads, self.state_size, self.head_dim,
                                        dtype_bytes, with_beta=False)
        own += 2 * heads * FP32_BYTES  # exp(A_log) and its negation
        own += 3 * tokens * inner * dtype_bytes  # the gate, and the gated product's factors
        norm = {"norm": rms_norm_saved_bytes(tokens, self.inner // self.groups, dtype_bytes, False, self.groups // tp)} \
            if self.gated_norm else {}
        return {"in_proj_x": tokens * self.hidden * dtype_bytes, "conv_x": conv(inner), "conv_B": conv(states),
                "conv_C": conv(states), "": own, **norm, "out_proj": tokens * inner * dtype_bytes}


class Mamba2Mixer(RecurrentMixer):
    def forward(self, hidden, positions=None, carry: Carry | None = None):
        """`positions`: each token's position in its document under per-document training, else None."""
        declared = self.declared
        hidden, positions = self.whole_sequences(hidden, positions)
        if declared.in_multiplier != 1.0:
            hidden = hidden * declared.in_multiplier
        batch, length = hidden.shape[:2]
        x, b, c = self.convolved(hidden, "xBC", positions, carry)
        x = x.reshape([batch, length, -1, declared.head_dim])
        b, c = (part.reshape([batch, length, -1, declared.state_size]) for part in (b, c))
        dt = paddle.clip(F.softplus(self.projected("dt", hidden).astype("float32") + self.dt_bias), *declared.dt_limit)
        out = self.rule(c, b, x.astype("float32") * dt.unsqueeze(-1), dt * -paddle.exp(self.A_log.astype("float32")),
                        None, positions, carry)
        out = (out + x.astype("float32") * self.D.unsqueeze(-1)).reshape([batch, length, -1])
        gate = F.silu(self.projected("z", hidden).astype("float32"))
        if declared.gated_norm == GATE_THEN_NORM:
            out = self.norm(out * gate)
        else:
            out = (out if declared.gated_norm is None else self.norm(out)) * gate
        return self.projected_out(out.astype(hidden.dtype))

    def projected(self, name: str, hidden):
        """in_proj_<name>(hidden), times its multiplier."""
        multiplier = self.declared.multipliers[IN_PROJ.index(f"in_proj_{name}")]
        out = getattr(self, f"in_proj_{name}")(hidden)
        return out if multiplier == 1.0 else out * multiplier


Mamba2.layer = Mamba2Mixer


def fused_mamba2(stored: Stored, mixer: Mamba2, name: str) -> Stored:
    """Where transformers' folders keep our tensor `stored` names, when it is one of a Mamba-2 mixer's
    (a decoder layer's part `name`, of `mixer`'s sizes) projections or convs: a slice of the fused
    `in_proj` (z | x | B | C | dt rows) or `conv1d` (x | B | C channels, weight and bias)."""
    module, _, param = stored.name.rpartition(".")
    prefix, _, part = module.rpartition(".")
    if not prefix.endswith(f".{name}"):
        return stored
    inner, states = mixer.inner, mixer.groups * mixer.state_size
    if part in IN_PROJ:
        return replace(stored, name=f"{prefix}.in_proj.{param}", axis=0, part=IN_PROJ.index(part), parts=5,
                       sizes=(inner, inner, states, states, mixer.heads))
    if part in CONV:
        return replace(stored, name=f"{prefix}.conv1d.{param}", axis=0, part=CONV.index(part), parts=3,
                       sizes=(inner, states, states))
    return stored
