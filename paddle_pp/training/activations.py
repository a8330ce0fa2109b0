"""What a forward pass keeps for backward, measured: the activation memory a layout costs per rank.

Every tensor an op or PyLayer saves for its backward passes through Paddle's `saved_tensors_hooks`;
counting each storage once (several ops save the same tensor) and leaving parameters out gives the
activation bytes, attributed to the innermost named sublayer that was running when it was saved.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import paddle
from paddle import nn


def saved_activation_bytes(model: nn.Layer, run: Callable[[], object]) -> dict[str, int]:
    """Bytes saved for backward while `run()` does a forward through `model`, by the name of the
    innermost sublayer of `model` that saved them ("" for the model itself)."""
    parameters = {p.data_ptr() for p in model.parameters()}
    running: list[str] = []
    seen: set[int] = set()
    by_layer: dict[str, int] = defaultdict(int)

    def pack(tensor):
        pointer = tensor.data_ptr()
        if pointer not in parameters and pointer not in seen:
            seen.add(pointer)
            by_layer[running[-1] if running else ""] += int(tensor.numel()) * tensor.element_size()
        return tensor

    def entering(name: str):
        def hook(_layer, _inputs) -> None:  # a hook's non-None return would replace the inputs
            running.append(name)
        return hook

    def leaving(_layer, _inputs, _outputs) -> None:
        running.pop()

    handles = []
    for name, layer in model.named_sublayers():
        handles += [layer.register_forward_pre_hook(entering(name)), layer.register_forward_post_hook(leaving)]
    try:
        with paddle.autograd.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return dict(by_layer)


def decoder_layer_activations(model: nn.Layer, vocab_size: int, batch: int, seq_len: int) -> dict[str, int]:
    """Bytes the first decoder layer keeps for backward on this rank during a training forward of
    the whole `model` (a `*ForCausalLM`) on `batch` x `seq_len` tokens, by its sublayers' names
    relative to it ("" for what the layer's own code saves: residual adds, the block's glue)."""
    layer = next(name for name, _ in model.named_sublayers() if name.endswith("layers.0"))
    paddle.seed(0)  # the same tokens on every tp rank
    ids = paddle.randint(0, vocab_size, [batch, seq_len])
    by_layer = saved_activation_bytes(model, lambda: model(ids, labels=ids))
    return {name.removeprefix(layer).lstrip("."): size for name, size in by_layer.items()
            if name == layer or name.startswith(layer + ".")}
