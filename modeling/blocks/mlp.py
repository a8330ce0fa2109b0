"""The gated MLP (SwiGLU for LLaMA-like families, GeGLU with tanh GeLU for Gemma) and the
activations the families use, by transformers' names."""

from __future__ import annotations

from functools import lru_cache, partial

import paddle.nn.functional as F

from modeling.blocks.parts import Block, ColumnLinear, Part, RowLinear
from modeling.execution import Execution
from modeling.sequence_parallel import gather_tokens

# transformers' `hidden_act` names -> the function (gelu_new and gelu_pytorch_tanh are both GeLU's tanh form)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": partial(F.gelu, approximate=False),
               "gelu_pytorch_tanh": partial(F.gelu, approximate=True), "gelu_new": partial(F.gelu, approximate=True)}
SILU = ("silu", "swish")  # what Paddle's fused swiglu computes: silu(gate) * up


class GatedMLP(Block):
    """down(act(gate(x)) * up(x)); reads `hidden_act` and `mlp_bias` from the config, its width from
    the config field `width` (a dense layer's `intermediate_size`; experts have their own), its
    projections' names from `names` (transformers' LLaMA names; Mixtral's experts say w1, w3, w2).
    A run with `kernels.swiglu` computes silu(gate) * up with Paddle's fused `swiglu` (as PaddleNLP's
    LLaMA, which imports it from paddle.incubate, where Paddle 3.3.1 marks it deprecated for this one)."""

    width = "intermediate_size"
    names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def declare(cls, c) -> dict[str, Part]:
        h, f = c.hidden_size, getattr(c, cls.width)
        gate, up, down = cls.names
        return {gate: ColumnLinear(h, f, c.mlp_bias), up: ColumnLinear(h, f, c.mlp_bias),
                down: RowLinear(f, h, c.mlp_bias)}

    @classmethod
    def tp_fields(cls, config) -> tuple[str, ...]:
        return (cls.width,)

    def __init__(self, config, run: Execution):
        super().__init__(config, run)
        if run.kernels.swiglu and config.hidden_act in SILU:
            self.gated = F.swiglu
        else:
            act = ACTIVATIONS[config.hidden_act]
            self.gated = lambda gate, up: act(gate) * up

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.names)
        x = gather_tokens(x, self.run)
        return down(self.gated(gate(x), up(x)))

    @classmethod
    def saved_bytes(cls, c, run: Execution, tokens: int, dtype_bytes: int) -> dict[str, int]:
        """gate and up share one saved input (full-size under SP); the activation's input, its output
        and up's output stay for the product and the activation's backward (the fused swiglu keeps its
        two inputs only; measured on CPU, where it has a kernel)."""
        width = getattr(c, cls.width) // run.tp * dtype_bytes
        glue = 2 if run.kernels.swiglu and c.hidden_act in SILU else 3
        gate, _, down = cls.names
        return {gate: tokens * c.hidden_size * dtype_bytes, "": glue * tokens * width, down: tokens * width}


@lru_cache(maxsize=None)
def gated_mlp(width: str, names: tuple[str, str, str] = GatedMLP.names) -> type[GatedMLP]:
    """The gated MLP of another width field or other projection names (experts, a shared expert)."""
    if (width, names) == (GatedMLP.width, GatedMLP.names):
        return GatedMLP
    return type(f"GatedMLP_{width}_{'_'.join(names)}", (GatedMLP,), {"width": width, "names": names,
                                                                      "__module__": __name__})
