"""Generation that carries state from token to token, for models with recurrent token mixers (Gated
DeltaNet, Kimi Delta, Mamba-2): after the prompt, each new token runs alone through the model.

Each recurrent mixer keeps its convs' last inputs and its rule's state (`Carry`) and starts the next
token from them, as transformers' cache does, instead of running the whole window again. Attention
has no key/value cache here: each attention mixer keeps the inputs it has seen (at most `window`) and
runs again over them and the new token, keeping the new token's output (the positions the rotary
needs are those of the kept inputs). So a step costs the recurrent layers one token's work, and the
attention layers what a window's attention costs, not the whole model's.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator

import paddle
from paddle import nn

from modeling.blocks.attention import SelfAttention
from modeling.blocks.gated_delta import Carry, RecurrentMixer
from modeling.blocks.latent_attention import LatentSelfAttention


def carries_state(model: nn.Layer) -> bool:
    """Whether `model` has a recurrent mixer, whose state generation can carry."""
    return any(isinstance(layer, RecurrentMixer) for layer in model.sublayers())


class _Attending:
    """An attention mixer's inputs so far, and its forward over them and the new ones."""

    def __init__(self, forward, window: int):
        self.forward, self.window, self.seen = forward, window, None

    def __call__(self, hidden, positions=None):
        seen = hidden if self.seen is None else paddle.concat([self.seen, hidden], axis=1)
        self.seen = seen[:, -self.window:]
        return self.forward(self.seen, positions)[:, -hidden.shape[1]:]


@contextmanager
def carrying(model: nn.Layer, window: int) -> Iterator[None]:
    """Within it, each call of `model` continues the sequence of the calls before (one process, batch
    first, no per-document positions): its recurrent mixers carry their state, its attention mixers
    their inputs (the last `window`)."""
    patched = []
    for layer in model.sublayers():
        if isinstance(layer, RecurrentMixer):
            layer.forward = partial(type(layer).forward, layer, carry=Carry())
        elif isinstance(layer, (SelfAttention, LatentSelfAttention)):
            layer.forward = _Attending(partial(type(layer).forward, layer), window)
        else:
            continue
        patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward
