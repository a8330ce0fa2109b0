"""Stage3's flat parameter slices as the single-card tensors a checkpoint holds.

Under `--sharding stage3` Paddle keeps each parameter of more than the segment size as one flat
slice per sharding rank: the (TP-local) tensor flattened, padded to a multiple of the group size,
rank r holding elements [r * n, (r + 1) * n). The optimizer states of such a parameter are slices
of the same shape, under the name "slice@<parameter>". A save gathers one tensor at a time over the
sharding group (memory bounded by the largest tensor); a load cuts this rank's range out of the
tensor it reads. Smaller parameters stay whole on every rank and need nothing from here.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import paddle
import paddle.distributed as dist

from checkpoint.piece import FlatRange, Piece
from paddle_pp.runtime.stage3 import is_sliced


class FlatSlice:
    """This rank's flat piece (`storage`) of a tensor shaped `shape` (the TP-local shape), standing
    in for the tensor in saves (`.shape`, `.dtype`, `gather`) and loads (`assign`); which elements
    it holds is its `Piece`'s flat case (`flat`)."""

    def __init__(self, storage: paddle.Tensor, shape: list[int], rank: int, group):
        self.storage, self.shape, self.group = storage, list(shape), group
        self.flat = FlatRange(rank, group.nranks, int(np.prod(storage.shape)))
        self.dtype = storage.dtype

    def gather(self, root: int) -> paddle.Tensor | None:
        """The whole tensor on sharding rank `root`, from every rank's piece (a collective over the
        sharding group; None on the other ranks, which only send: an all-gather would give every
        rank the whole tensor)."""
        piece = self.storage.detach().reshape([-1])
        mine = self.flat.rank == root
        parts = [paddle.empty_like(piece) for _ in range(self.group.nranks)] if mine else []
        dist.gather(piece, parts, dst=self.group.ranks[root], group=self.group)
        if not mine:
            return None
        return paddle.concat(parts)[: int(np.prod(self.shape))].reshape(self.shape)

    def assign(self, flat: np.ndarray) -> None:
        """Set this rank's piece from `flat`, its slice as `Piece.flat_slice` cuts it (padding zero)."""
        self.storage.set_value(flat.reshape(self.storage.shape).astype(str(self.dtype).removeprefix("paddle.")))


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


def held_piece(tensor, axis: int | None, topo, whole: bool = False) -> Piece:
    """The part of its single-card tensor that `tensor` (as `as_saved` gives it) is on this rank:
    its TP piece along `axis` (the whole tensor, its axis kept for the index, where the tensor is
    `whole` at this degree: `ModelPlan.whole_at`), and its stage3 slice of that when it is a `FlatSlice`."""
    piece = Piece(axis, 1, 0) if whole else Piece(axis, topo.layout.tp, topo.tp_rank)
    return replace(piece, flat=tensor.flat) if isinstance(tensor, FlatSlice) else piece
