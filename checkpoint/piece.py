"""Which part of a single-card tensor a rank holds, writes or reads: one value for every case.

A checkpoint stores single-card tensors; a rank holds a part of one. Under tensor parallelism the
part is the `part`-th of `parts` equal pieces along `axis`; under sharding stage3 it is further a
flat slice of that TP piece (flattened, padded, `width` elements from `rank * width`). Saves,
loads, the shard reader, the piece writer, pre-split copies and fleet merges all pass a `Piece`
instead of a bare axis with the degrees beside it, so the rule for a part is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from modeling.placement import local_shape, single_card_shape, split_tensor


@dataclass(frozen=True)
class FlatRange:
    """Stage3's slice of a (TP-local) tensor: elements [rank * width, (rank + 1) * width) of it
    flattened, zero beyond its end (Paddle pads the flat tensor to a multiple of the group)."""

    rank: int
    ranks: int
    width: int


@dataclass(frozen=True)
class Piece:
    """The whole tensor (`WHOLE`), its TP piece (`part` of `parts` along `axis`), or a stage3 slice of
    either (`flat`). `axis` is how TP splits the tensor, kept where nothing splits it (`parts` 1, or
    a replicated tensor's None), since an index records it for loads under other layouts."""

    axis: int | None = None
    parts: int = 1
    part: int = 0
    flat: FlatRange | None = None

    @property
    def split(self) -> bool:
        """TP splits the tensor: its ranks hold different pieces of it."""
        return self.axis is not None and self.parts > 1

    @property
    def tp_piece(self) -> Piece:
        """The TP piece this stage3 slice is cut from (itself when not sliced)."""
        return Piece(self.axis, self.parts, self.part)

    @property
    def in_tp_piece(self) -> Piece:
        """This part as read from a file that holds its TP piece whole (a pre-split copy)."""
        return Piece(flat=self.flat)

    @property
    def slices(self) -> int:
        """How many stage3 slices make up the TP piece (1: held whole)."""
        return self.flat.ranks if self.flat is not None else 1

    def local_shape(self, full: list[int] | tuple[int, ...]) -> list[int]:
        """The TP piece's shape for a tensor of single-card shape `full`."""
        return list(local_shape(full, self.axis, self.parts))

    def full_shape(self, local: list[int] | tuple[int, ...]) -> list[int]:
        """The single-card shape of a tensor whose TP piece is shaped `local`."""
        return single_card_shape(local, self.axis, self.parts)

    def cut(self, whole: np.ndarray) -> np.ndarray:
        """This TP piece of the single-card array `whole` (a view)."""
        return split_tensor(whole, self.axis, self.parts, self.part)

    def flat_slice(self, tp_piece: np.ndarray) -> np.ndarray:
        """The stage3 slice (flat, `width` long, zero-padded) of the TP piece `tp_piece`."""
        if self.flat is None:
            return tp_piece
        width, start = self.flat.width, self.flat.rank * self.flat.width
        flat = np.ascontiguousarray(tp_piece).reshape(-1)[start:start + width]
        padded = np.zeros(width, tp_piece.dtype)
        padded[: flat.size] = flat
        return padded

    def describe(self) -> str | None:
        """What a report names this part as (None for the whole tensor)."""
        parts = ([f"tp piece {self.part}"] if self.split else []) + \
            ([f"stage3 slice {self.flat.rank}"] if self.flat is not None else [])
        return ", ".join(parts) or None


WHOLE = Piece()
