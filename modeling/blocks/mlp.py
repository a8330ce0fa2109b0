"""The feed-forward parts: the gated MLP (SwiGLU for LLaMA-like families, GeGLU with tanh GeLU for
Gemma), the plain two-layer MLP (GPT-2, MPT), and the activations the families use, by transformers'
names."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import paddle
import paddle.nn.functional as F

from modeling.blocks.parts import Block, ColumnLinear, Declared, Part, RowLinear
from modeling.execution import Execution
from modeling.sequence_parallel import gather_tokens


def relu_squared(x):
    """relu(x)^2 (transformers' `relu2`: Nemotron-H's MLPs and experts)."""
    return F.relu(x).square()


# transformers' `hidden_act` names -> the function (gelu_new and gelu_pytorch_tanh are both GeLU's tanh form)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": partial(F.gelu, approximate=False),
               "gelu_pytorch_tanh": partial(F.gelu, approximate=True), "gelu_new": partial(F.gelu, approximate=True),
               "relu2": relu_squared}
SILU = ("silu", "swish")  # what Paddle's fused swiglu computes: silu(gate) * up
GATED_NAMES = ("gate_proj", "up_proj", "down_proj")  # transformers' LLaMA names (Mixtral's experts: w1, w3, w2)


@dataclass(frozen=True)
class GatedMLP(Declared):
    """down(act(gate(x)) * up(x)), `width` wide (a dense layer's intermediate_size; experts have
    their own), its projections named `names`. A run with `kernels.swiglu` computes silu(gate) * up
    with Paddle's fused `swiglu` (as PaddleNLP's LLaMA, which imports it from paddle.incubate, where
    Paddle 3.3.1 marks it deprecated for this one)."""

    hidden: int
    width: int
    activation: str = "silu"
    bias: bool = False
    names: tuple[str, str, str] = GATED_NAMES
    unit: str = "intermediate_size"  # the config field its width is (named when tp does not divide it)
    limit: float | None = None  # GPT-OSS: gate clamped above, up to [-limit, limit], (up + 1) x gate x sigmoid(alpha gate)
    alpha: float = 1.0
    multipliers: tuple[float, float] = (1.0, 1.0)  # Falcon-H1: gate's output and down's times these (scale ops)

    def parts(self) -> dict[str, Part]:
        gate, up, down = self.names
        return {gate: ColumnLinear(self.hidden, self.width, self.bias), up: ColumnLinear(self.hidden, self.width, self.bias),
                down: RowLinear(self.width, self.hidden, self.bias)}

    def own_tp_units(self) -> dict[str, int]:
        return {self.unit: self.width}

    def fused(self, run: Execution) -> bool:
        return run.kernels.swiglu and self.activation in SILU and self.limit is None and self.multipliers == (1.0, 1.0)

    def saved_bytes(self, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        """gate and up share one saved input (full-size under SP); the activation's input, its output
        and up's output stay for the product and the activation's backward (the fused swiglu keeps its
        two inputs only; measured on CPU, where it has a kernel)."""
        width = self.width // run.tp * dtype_bytes
        gate, _, down = self.names
        return {gate: tokens * self.hidden * dtype_bytes, "": (2 if self.fused(run) else 3) * tokens * width,
                down: tokens * width}


class GatedMLPLayer(Block):
    def __init__(self, config, run: Execution, declared: GatedMLP):
        super().__init__(config, run, declared)
        if declared.fused(run):
            self.gated = F.swiglu
        elif declared.limit is not None:
            self.gated = partial(clamped_swiglu, limit=declared.limit, alpha=declared.alpha)
        else:
            act = ACTIVATIONS[declared.activation]
            self.gated = lambda gate, up: act(gate) * up

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.declared.names)
        x = gather_tokens(x, self.run)
        into, out = self.declared.multipliers
        if (into, out) == (1.0, 1.0):
            return down(self.gated(gate(x), up(x)))
        return down(self.gated(gate(x) * into, up(x))) * out

    def partial_sum(self, rows):
        """This tp rank's share of the MLP on `rows` every tp rank holds, without the collectives of its
        split projections: its share of the intermediate, then its partial sum of the output (the output
        bias left out: added once the partial sums are). What experts under SP run."""
        gate, up, down = (getattr(self, name) for name in self.declared.names)
        return F.linear(self.gated(F.linear(rows, gate.weight, gate.bias), F.linear(rows, up.weight, up.bias)),
                        down.weight)


GatedMLP.layer = GatedMLPLayer


def clamped_swiglu(gate, up, limit: float, alpha: float):
    """GPT-OSS's gated activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) x gate x sigmoid(alpha x gate)."""
    gate = paddle.clip(gate, max=limit)
    return (paddle.clip(up, -limit, limit) + 1) * gate * F.sigmoid(alpha * gate)


@dataclass(frozen=True)
class PlainMLP(Declared):
    """down(act(up(x))): GPT-2's linear1/linear2 with biases and tanh GeLU, MPT's up_proj/down_proj
    without biases and with exact GeLU."""

    hidden: int
    width: int
    activation: str = "gelu_new"
    bias: bool = True
    names: tuple[str, str] = ("up_proj", "down_proj")
    unit: str = "intermediate_size"  # the config field its width is (named when tp does not divide it)

    def parts(self) -> dict[str, Part]:
        up, down = self.names
        return {up: ColumnLinear(self.hidden, self.width, self.bias), down: RowLinear(self.width, self.hidden, self.bias)}

    def own_tp_units(self) -> dict[str, int]:
        return {self.unit: self.width}

    def saved_bytes(self, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        """The input (full-size under SP), the activation's input and its output."""
        width = self.width // run.tp * dtype_bytes
        up, down = self.names
        return {up: tokens * self.hidden * dtype_bytes, "": tokens * width, down: tokens * width}


class PlainMLPLayer(Block):
    def forward(self, x):
        up, down = (getattr(self, name) for name in self.declared.names)
        return down(ACTIVATIONS[self.declared.activation](up(gather_tokens(x, self.run))))

    def partial_sum(self, rows):
        """As `GatedMLPLayer.partial_sum`."""
        up, down = (getattr(self, name) for name in self.declared.names)
        return F.linear(ACTIVATIONS[self.declared.activation](F.linear(rows, up.weight, up.bias)), down.weight)


PlainMLP.layer = PlainMLPLayer
