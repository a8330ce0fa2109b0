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


def test_xielu_backward_keeps_its_input_only_and_equals_autograd():
    """Apertus's learned activation: output (1e-6) and the gradients of its input and both weights (1e-5)
    equal autograd of transformers' formula, on inputs either side of 0 and of eps; it keeps only x."""
    from modeling.blocks.mlp import XIELU_BETA, XIELU_EPS, XIELULayer

    paddle.seed(1)
    layer = XIELULayer()
    with paddle.no_grad():
        layer.alpha_p.set_value(paddle.to_tensor([0.3]))
        layer.alpha_n.set_value(paddle.to_tensor([-0.7]))
    x = paddle.concat([paddle.randn([4, 30]) * 3, paddle.full([4, 2], XIELU_EPS * 2), paddle.full([4, 2], 1e-7)], -1)
    x.stop_gradient = False
    upstream = paddle.randn(x.shape)
    a_p = paddle.nn.functional.softplus(layer.alpha_p)
    a_n = XIELU_BETA + paddle.nn.functional.softplus(layer.alpha_n)
    reference = paddle.where(x > 0, a_p * x * x + XIELU_BETA * x,
                             (paddle.expm1(paddle.minimum(x, paddle.full([], XIELU_EPS))) - x) * a_n + XIELU_BETA * x)
    expected = paddle.grad((reference * upstream).sum(), [x, layer.alpha_p, layer.alpha_n])
    saved = []
    with paddle.autograd.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        got = layer(x)
    grads = paddle.grad((got * upstream).sum(), [x, layer.alpha_p, layer.alpha_n])
    np.testing.assert_allclose(got.numpy(), reference.numpy(), rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(grads, expected):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)
    assert [s for s in saved if np.prod(s) > 1] == [tuple(x.shape)], f"kept: {saved}"
