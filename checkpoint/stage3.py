"""Stage3's flat parameter slices as the single-card tensors a checkpoint holds.

Under `--sharding stage3` Paddle keeps each parameter of more than the segment size as one flat
slice per sharding rank: the (TP-local) tensor flattened, padded to a multiple of the group size,
rank r holding elements [r * n, (r + 1) * n). The optimizer states of such a parameter are slices
of the same shape, under the name "slice@<parameter>". A save gathers one tensor at a time over the
sharding group (memory bounded by the largest tensor); a load cuts this rank's range out of the
tensor it reads. Smaller parameters stay whole on every rank and need nothing from here.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_pp.runtime.stage3 import is_sliced


class FlatSlice:
    """This rank's flat piece of a tensor shaped `shape` (the TP-local shape), standing in for the
    tensor in saves (`.shape`, `.dtype`, `gather`) and loads (`assign`)."""

    def __init__(self, piece: paddle.Tensor, shape: list[int], rank: int, group):
        self.piece, self.shape, self.rank, self.group = piece, list(shape), rank, group
        self.dtype = piece.dtype

    def gather(self, root: int) -> paddle.Tensor | None:
        """The whole tensor on sharding rank `root`, from every rank's piece (a collective over the
        sharding group; None on the other ranks, which only send: an all-gather would give every
        rank the whole tensor)."""
        piece = self.piece.detach().reshape([-1])
        parts = [paddle.empty_like(piece) for _ in range(self.group.nranks)] if self.rank == root else []
        dist.gather(piece, parts, dst=self.group.ranks[root], group=self.group)
        if self.rank != root:
            return None
        return paddle.concat(parts)[: int(np.prod(self.shape))].reshape(self.shape)

    def assign(self, array: np.ndarray) -> None:
        """Set this rank's piece from the whole tensor `array` (padding stays zero)."""
        width = int(np.prod(self.piece.shape))
        flat = array.reshape(-1)[self.rank * width:(self.rank + 1) * width]
        piece = np.zeros(width, flat.dtype)
        piece[: flat.size] = flat
        self.piece.set_value(piece.reshape(self.piece.shape).astype(str(self.dtype).removeprefix("paddle.")))


def as_saved(param, tensor, topo):
    """`tensor` (a parameter, or an optimizer state of `param`) as the save and load see it: a
    `FlatSlice` when stage3 holds it as a flat piece, else itself."""
    if not is_sliced(param) or list(tensor.shape) == [1]:  # beta powers: one value per parameter
        return tensor
    return FlatSlice(tensor, param.shape, topo.sharding_rank, topo.sharding_group)


def model_tensors(state: dict, topo) -> dict:
    """A model's `state_dict()` with each stage3-sliced parameter as a `FlatSlice` of its current piece."""
    return {name: as_saved(param, param.fw_storage, topo) if is_sliced(param) else param
            for name, param in state.items()}
