"""The feed-forward parts: the gated MLP (SwiGLU for LLaMA-like families, GeGLU with tanh GeLU for
Gemma), the plain two-layer MLP (GPT-2, MPT), and the activations the families use, by transformers'
names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from modeling import tp_gradients
from modeling.autocast import full_precision
from modeling.blocks.parts import Block, ColumnLinear, Declared, Leaf, Part, RowLinear
from modeling.execution import Execution
from modeling.lora import partial_linear
from modeling.placement import ALWAYS, REPLICATED, Placement, TensorPlan
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
        bias left out: added once the partial sums are). What experts under SP run, LoRA adapters included."""
        gate, up, down = (getattr(self, name) for name in self.declared.names)
        return partial_linear(down, self.gated(partial_linear(gate, rows), partial_linear(up, rows)), bias=False)


GatedMLP.layer = GatedMLPLayer


def clamped_swiglu(gate, up, limit: float, alpha: float):
    """GPT-OSS's gated activation: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) x gate x sigmoid(alpha x gate)."""
    gate = paddle.clip(gate, max=limit)
    return (paddle.clip(up, -limit, limit) + 1) * gate * F.sigmoid(alpha * gate)


XIELU = "xielu"  # an activation with weights of its own (`LearnedActivation`)
XIELU_BETA, XIELU_EPS = 0.5, -1e-6  # transformers' XIELUActivation defaults, stored as buffers in every folder
# its two weights and where transformers starts them: softplus(alpha_p) = 0.8, beta + softplus(alpha_n) = 0.8
XIELU_WEIGHTS = (("alpha_p", 0.8), ("alpha_n", 0.8 - XIELU_BETA))
XIELU_BUFFERS = (("beta", XIELU_BETA), ("eps", XIELU_EPS))


def _inverse_softplus(value: float) -> float:
    return math.log(math.expm1(value))


@dataclass(frozen=True)
class LearnedActivation(Leaf):
    """xIELU (Huang et al. 2024; Apertus): x > 0: a_p x^2 + beta x, else (expm1(min(x, eps)) - x) a_n + beta x,
    with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n) learned per layer (alpha_p from
    softplus^-1(0.8), alpha_n from softplus^-1(0.3)) and beta, eps persistent buffers (transformers saves
    them). Every tp rank holds the two weights whole and sees only its columns of the MLP: each rank's
    gradient is a part, summed over tp at the update (as a per-head norm's)."""

    def tensors(self) -> dict[str, TensorPlan]:
        learned = {name: TensorPlan((1,), Placement(REPLICATED), init=_inverse_softplus(value), tp_partial_grad=ALWAYS)
                   for name, value in XIELU_WEIGHTS}
        return learned | {name: TensorPlan((), Placement(REPLICATED), init=value, buffer=True)
                          for name, value in XIELU_BUFFERS}

    def build(self, config, run: Execution) -> nn.Layer:
        return tp_gradients.mark(XIELULayer(), run, always=True)


class XIELULayer(nn.Layer):
    def __init__(self):
        super().__init__()
        for name, value in XIELU_WEIGHTS:
            self.add_parameter(name, self.create_parameter(
                [1], default_initializer=nn.initializer.Constant(_inverse_softplus(value))))
        for name, value in XIELU_BUFFERS:
            self.register_buffer(name, paddle.to_tensor(value, "float32"))
            # constants, equal on every rank: fleet's coalesced broadcast of parameters and buffers would
            # hand a 0-d one back as [1] (Paddle 3.3.1's sync_params_buffers splits without reshaping)
            getattr(self, name).no_sync = True

    def forward(self, x):
        return _XIELU.apply(x, self.alpha_p, self.alpha_n, float(self.beta), float(self.eps))


class _XIELU(PyLayer):
    """xIELU keeping its input only (autograd would keep four input-sized tensors and a mask); the
    backward recomputes: dy/dx = 2 a_p x + beta for x > 0, else (exp(x) [x < eps] - 1) a_n + beta;
    dy/da_p = x^2 and dy/da_n = expm1(min(x, eps)) - x on their sides, through softplus's sigmoid."""

    @staticmethod
    def forward(ctx, x, alpha_p, alpha_n, beta: float, eps: float):
        ctx.save_for_backward(x, alpha_p, alpha_n)
        ctx.constants = (beta, eps)
        a_p, a_n = F.softplus(alpha_p).astype(x.dtype), (beta + F.softplus(alpha_n)).astype(x.dtype)
        negative = (paddle.expm1(paddle.clip(x, max=eps)) - x) * a_n
        return paddle.where(x > 0, a_p * x * x, negative) + beta * x

    @staticmethod
    def backward(ctx, dy):
        x, alpha_p, alpha_n = ctx.saved_tensor()
        beta, eps = ctx.constants
        with full_precision():
            x32, dy32 = x.astype("float32"), dy.astype("float32")
            a_p, a_n = F.softplus(alpha_p.astype("float32")), beta + F.softplus(alpha_n.astype("float32"))
            positive = x32 > 0
            below = paddle.clip(x32, max=eps)
            dx = paddle.where(positive, 2 * a_p * x32, (paddle.exp(below) * (x32 < eps).astype("float32") - 1) * a_n)
            d_p = (dy32 * paddle.where(positive, x32 * x32, paddle.zeros_like(x32))).sum() * F.sigmoid(alpha_p)
            d_n = (dy32 * paddle.where(positive, paddle.zeros_like(x32), paddle.expm1(below) - x32)).sum() * \
                F.sigmoid(alpha_n)
        return ((dx + beta) * dy32).astype(x.dtype), d_p.reshape([1]).astype(alpha_p.dtype), \
            d_n.reshape([1]).astype(alpha_n.dtype)


@dataclass(frozen=True)
class PlainMLP(Declared):
    """down(act(up(x))): GPT-2's linear1/linear2 with biases and tanh GeLU, MPT's up_proj/down_proj
    without biases and with exact GeLU, Apertus's without biases and with its learned xIELU (`act_fn`)."""

    hidden: int
    width: int
    activation: str = "gelu_new"
    bias: bool = True
    names: tuple[str, str] = ("up_proj", "down_proj")
    unit: str = "intermediate_size"  # the config field its width is (named when tp does not divide it)

    def parts(self) -> dict[str, Part]:
        up, down = self.names
        learned = {"act_fn": LearnedActivation()} if self.activation == XIELU else {}
        return {up: ColumnLinear(self.hidden, self.width, self.bias), **learned,
                down: RowLinear(self.width, self.hidden, self.bias)}

    def own_tp_units(self) -> dict[str, int]:
        return {self.unit: self.width}

    def saved_bytes(self, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        """The input (full-size under SP), the activation's input (kept by xIELU's own layer) and its
        output."""
        width = self.width // run.tp * dtype_bytes
        up, down = self.names
        into = {"act_fn": tokens * width} if self.activation == XIELU else {"": tokens * width}
        return {up: tokens * self.hidden * dtype_bytes, **into, down: tokens * width}


class PlainMLPLayer(Block):
    def activate(self, x):
        """Its activation: a function of the family's, or its own learned one (`act_fn`)."""
        return self.act_fn(x) if self.declared.activation == XIELU else ACTIVATIONS[self.declared.activation](x)

    def forward(self, x):
        up, down = (getattr(self, name) for name in self.declared.names)
        return down(self.activate(up(gather_tokens(x, self.run))))

    def partial_sum(self, rows):
        """As `GatedMLPLayer.partial_sum`."""
        up, down = (getattr(self, name) for name in self.declared.names)
        return partial_linear(down, self.activate(partial_linear(up, rows)), bias=False)


PlainMLP.layer = PlainMLPLayer
