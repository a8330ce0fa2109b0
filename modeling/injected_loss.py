"""A loss computed inside the model (an MoE layer's balance loss, the sparse-attention indexer's KL)
added to the objective where it is computed: an identity on the hidden states whose backward also
gives the loss the gradient 1, as if it were added to the final loss, which under pipeline parallelism
lives on another stage. The caller scales it as the main loss is scaled (1 / accumulation steps)."""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer


class _Injected(PyLayer):
    @staticmethod
    def forward(ctx, hidden, loss):
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        # Paddle wants None back for an input without gradient (frozen weights: a sparse-attention warm-up)
        ctx.learns = (not hidden.stop_gradient, not loss.stop_gradient)
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.learns[0] else None,
                paddle.ones(ctx.loss_shape, ctx.loss_dtype) if ctx.learns[1] else None)


def inject(hidden: paddle.Tensor, loss: paddle.Tensor) -> paddle.Tensor:
    """`hidden`, with `loss` (already scaled) trained as part of the objective."""
    return _Injected.apply(hidden, loss)
