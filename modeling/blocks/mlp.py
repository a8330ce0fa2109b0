"""The gated MLP (SwiGLU for LLaMA-like families, GeGLU with tanh GeLU for Gemma) and the
activations the families use, by transformers' names."""

from __future__ import annotations

from functools import partial

import paddle.nn.functional as F

from modeling.blocks.parts import Block, ColumnLinear, Part, RowLinear
from modeling.sequence_parallel import gather_tokens

# transformers' `hidden_act` names -> the function (gelu_new and gelu_pytorch_tanh are both GeLU's tanh form)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": partial(F.gelu, approximate=False),
               "gelu_pytorch_tanh": partial(F.gelu, approximate=True), "gelu_new": partial(F.gelu, approximate=True)}


class GatedMLP(Block):
    """down(act(gate(x)) * up(x)); reads `hidden_act` and `mlp_bias` from the config."""

    @classmethod
    def declare(cls, c) -> dict[str, Part]:
        h, f = c.hidden_size, c.intermediate_size
        return {"gate_proj": ColumnLinear(h, f, c.mlp_bias), "up_proj": ColumnLinear(h, f, c.mlp_bias),
                "down_proj": RowLinear(f, h, c.mlp_bias)}

    @classmethod
    def tp_fields(cls, config) -> tuple[str, ...]:
        return ("intermediate_size",)

    def __init__(self, config):
        super().__init__(config)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        x = gather_tokens(x, self.config)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    @staticmethod
    def saved_bytes(c, tokens: int, tp: int, dtype_bytes: int) -> dict[str, int]:
        """gate and up share one saved input (full-size under SP); the activation's input, its output
        and up's output stay for the product and the activation's backward."""
        width = c.intermediate_size // tp * dtype_bytes
        return {"gate_proj": tokens * c.hidden_size * dtype_bytes, "": 3 * tokens * width, "down_proj": tokens * width}
