"""What a forward pass keeps for backward, measured: the activation memory a layout costs per rank.

Every tensor an op or PyLayer saves for its backward passes through Paddle's `saved_tensors_hooks`;
counting each storage once (several ops save the same tensor) and leaving out parameters and
constants built once (the rotary tables) gives the activation bytes, attributed to the innermost
named sublayer that was running when it was saved. Recompute hides what it holds behind hooks of
its own; `held_bytes` measures that through Paddle's CPU allocator instead.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Callable

import paddle
from paddle import nn

from modeling.blocks.attention import SelfAttention
from modeling.blocks.indexer import IndexerLayer
from modeling.blocks.latent_attention import LatentSelfAttention


def saved_activation_bytes(model: nn.Layer, run: Callable[[], object], constants: frozenset[int] = frozenset()
                           ) -> dict[str, int]:
    """Bytes saved for backward while `run()` does a forward through `model`, by the name of the
    innermost sublayer of `model` that saved them ("" for the model itself); tensors whose storage
    is a parameter's or a buffer's (or a view into one) or in `constants` (data pointers) are not activations."""
    parameters = sorted((p.data_ptr(), p.data_ptr() + int(p.numel()) * p.element_size())
                        for p in [*model.parameters(), *model.buffers()])
    starts = [start for start, _ in parameters]
    running: list[str] = []
    seen: set[int] = set()
    by_layer: dict[str, int] = defaultdict(int)

    def in_parameter(pointer: int) -> bool:  # a parameter's storage, or a view into it (a slice of a conv's taps)
        index = bisect.bisect_right(starts, pointer) - 1
        return index >= 0 and pointer < parameters[index][1]

    def pack(tensor):
        pointer = tensor.data_ptr()
        if not in_parameter(pointer) and pointer not in constants and pointer not in seen:
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
    by_layer = saved_activation_bytes(model, lambda: model(ids, labels=ids),
                                      rotary_constants(model, seq_len, model.run.sequence_first))
    return {name.removeprefix(layer).lstrip("."): size for name, size in by_layer.items()
            if name == layer or name.startswith(layer + ".")}


def rotary_constants(model: nn.Layer, seq_len: int, seq_first: bool = False,
                     cp: tuple[int, int] = (1, 0)) -> frozenset[int]:
    """The data pointers of the rotary tables `model`'s attention layers use for `seq_len` local
    tokens: constants built once per layer kind and length, not activations."""
    rotaries = {(layer.declared.rotary, seq_first) for layer in model.sublayers(include_self=True)
                if isinstance(layer, (SelfAttention, LatentSelfAttention)) and layer.declared.rotary is not None}
    # sparse attention's indexers rotate batch first, without cp (refused beside them)
    rotaries |= {(layer.declared.rotary, False) for layer in model.sublayers(include_self=True)
                 if isinstance(layer, IndexerLayer)}
    return frozenset(table.data_ptr() for rotary, first in rotaries for table in rotary.tables(seq_len, first, cp))


def host_allocated() -> int:
    """Bytes Paddle's CPU allocator holds now (its own statistic; tensors on a GPU are not counted)."""
    from paddle.base import core

    return int(core.host_memory_stat_current_value("Allocated", 0))


def held_bytes(forward: Callable[[], object]) -> int:
    """Bytes a training forward leaves allocated for its backward, measured by Paddle's CPU allocator:
    what stays allocated after `forward()` with autograd on, less what stays after the same forward
    under no_grad (its result, alive in both). Unlike the saved-tensor hooks it also sees what
    recompute holds (recompute keeps its inputs in closures, behind hooks of its own); call once
    beforehand so constants built on first use (rotary tables, masks) exist in both."""
    start = host_allocated()
    with paddle.no_grad():
        result = forward()
    without_graph = host_allocated() - start
    del result
    start = host_allocated()
    result = forward()
    with_graph = host_allocated() - start
    del result
    return with_graph - without_graph
