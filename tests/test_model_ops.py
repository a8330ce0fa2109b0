"""Hand-written backward passes of model ops against autograd of the same formula (fp32, one process)."""

from __future__ import annotations

import numpy as np
import paddle

from modeling.blocks.rotary import apply_rotary, rotate_half
from modeling.llama import LlamaConfig


def test_rotary_backward_keeps_only_the_tables_and_equals_autograd():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1)
    paddle.seed(0)
    for seq_first in (False, True):
        cos, sin = config.rotary(0).tables(12, seq_first, (1, 0))
        shape = [12, 3, 4, 16] if seq_first else [3, 12, 4, 16]
        x, upstream = paddle.randn(shape), paddle.randn(shape)
        x.stop_gradient = False
        reference = x * cos.expand(shape) + rotate_half(x) * sin.expand(shape)
        (expected,) = paddle.grad((reference * upstream).sum(), x)
        saved = []
        with paddle.autograd.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            rotated = apply_rotary(x, cos, sin)
        (got,) = paddle.grad((rotated * upstream).sum(), x)
        np.testing.assert_allclose(rotated.numpy(), reference.numpy(), rtol=1e-6)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)
        assert all(np.prod(s) < np.prod(shape) for s in saved), f"activation-sized tensors kept: {saved}"
