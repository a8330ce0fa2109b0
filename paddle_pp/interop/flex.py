"""Paddle's flex checkpoints (`paddle.distributed.flex_checkpoint`, what PaddleFormers 1.2 saves by
default) read as data, in one process.

A flex folder (PaddleFormers writes `model_state/`, `optimizer_state/` and `master_weight/`) holds one
pickled `<id>.metadata` (every tensor's pieces: global offset, local shape, global shape, dtype, and
under sharding stage1 v2 a flat range of the piece) and per-rank `<rank>_<id>.distcp` files
(`paddle.save` pickles of {name: array}) that hold each piece once. Both are read as data
(`paddle_pp.interop.pickled`): the pieces as a state dict, the metadata admitting only Paddle's
three metadata dataclasses, rebuilt as the plain records below without importing or calling
anything the file names. Whole tensors are assembled from the files
alone: Paddle 3.3.1's own multi-process flex loading moves every piece with `.cuda()` before
communicating and fails on CPU, and nothing here depends on it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import ml_dtypes
import numpy as np

from paddle_pp.interop.pickled import UnsafePickleError, load_pickled, load_pickled_record
from paddle_pp.runtime.errors import UserError

METADATA_MODULE = "paddle.distributed.flex_checkpoint.dcp.metadata"
FLEX_PARTS = ("model_state", "optimizer_state", "master_weight")  # PaddleFormers' subfolders


class FlexCheckpointError(UserError, ValueError):
    """A flex checkpoint folder that is missing pieces, or pieces that do not fit its metadata."""


@dataclass(frozen=True)
class FlexPiece:
    """`LocalTensorMetadata`: where one saved piece sits in its tensor."""

    global_offset: tuple
    local_shape: tuple
    dtype: str
    global_shape: tuple | None = None
    is_flattened: bool = False
    flattened_range: tuple | None = None


@dataclass(frozen=True)
class FlexPieceIndex:
    """`LocalTensorIndex`: a piece's key in the storage table."""

    tensor_key: str
    global_offset: tuple
    is_flattened: bool = False
    flattened_range: tuple | None = None
    replica_id: int | None = None
    local_shape: tuple | None = None


@dataclass
class Metadata:
    state_dict_metadata: dict | None = None
    storage_metadata: dict | None = None
    flat_mapping: dict | None = None


RECORDS = {(METADATA_MODULE, "LocalTensorMetadata"): FlexPiece, (METADATA_MODULE, "LocalTensorIndex"): FlexPieceIndex,
           (METADATA_MODULE, "Metadata"): Metadata}


def _numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


class FlexFolder:
    """One flex folder: its tensors' names, shapes and dtypes, and each tensor assembled whole."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        found = sorted(self.folder.glob("*.metadata"), key=lambda path: int(path.stem) if path.stem.isdigit() else -1)
        if not found:
            raise FlexCheckpointError(f"{self.folder} holds no flex checkpoint metadata (<id>.metadata)")
        self.metadata_file = found[-1]  # the newest save's (ids count up)
        self.metadata: Metadata = load_pickled_record(self.metadata_file, RECORDS)
        if not isinstance(self.metadata, Metadata) or not isinstance(self.metadata.state_dict_metadata, dict):
            raise FlexCheckpointError(f"{self.metadata_file} is not a flex checkpoint's metadata")
        self._files: dict[str, dict] = {}

    @cached_property
    def _storage(self) -> dict[tuple, str]:
        """(name, global offset, flat range) -> the file holding that piece (the first replica)."""
        table: dict[tuple, str] = {}
        for index, file in sorted(self.metadata.storage_metadata.items(), key=lambda item: item[0].replica_id or 0):
            table.setdefault((index.tensor_key, tuple(index.global_offset), index.flattened_range), file)
        return table

    def names(self) -> list[str]:
        return sorted(self.metadata.state_dict_metadata)

    def shape(self, name: str) -> tuple[int, ...]:
        piece = self.metadata.state_dict_metadata[name][0]
        return tuple(piece.global_shape if piece.global_shape is not None else piece.local_shape)

    def dtype(self, name: str) -> np.dtype:
        return _numpy_dtype(self.metadata.state_dict_metadata[name][0].dtype)

    def _file(self, name: str) -> dict:
        if name not in self._files:
            path = self.folder / name
            if not path.is_file():
                raise FlexCheckpointError(f"{path} is missing (the metadata names it)")
            self._files[name] = load_pickled(path)
        return self._files[name]

    def _piece_data(self, name: str, piece: FlexPiece) -> np.ndarray:
        key = (name, tuple(piece.global_offset), piece.flattened_range)
        if key not in self._storage:
            raise FlexCheckpointError(f"{self.metadata_file}: no file holds {name}'s piece at {piece.global_offset}")
        held = self._file(self._storage[key])
        if name not in held:
            raise FlexCheckpointError(f"{self.folder / self._storage[key]} lacks {name}")
        data = np.asarray(held[name])
        wanted = _numpy_dtype(piece.dtype)
        if data.dtype != wanted:  # Paddle keeps bfloat16 as uint16 in numpy
            data = data.view(wanted) if data.dtype.itemsize == wanted.itemsize else data.astype(wanted)
        size = (piece.flattened_range[1] - piece.flattened_range[0]) if piece.is_flattened \
            else int(np.prod(piece.local_shape, dtype=np.int64))
        if data.size != size:
            raise FlexCheckpointError(f"{name}'s piece at {piece.global_offset} holds {data.size} values, its metadata "
                                      f"says {size}")
        return data

    def tensor(self, name: str) -> np.ndarray:
        """`name` whole, from its pieces (a flattened piece fills its range of its region, row-major);
        every element must come from some piece."""
        if name not in self.metadata.state_dict_metadata:
            raise FlexCheckpointError(f"{self.folder} has no tensor {name}")
        shape = self.shape(name)
        whole = np.zeros(shape, self.dtype(name))
        written = np.zeros(shape, bool)
        for piece in self.metadata.state_dict_metadata[name]:
            region = tuple(slice(start, start + length) for start, length in zip(piece.global_offset, piece.local_shape))
            data = self._piece_data(name, piece)
            if piece.is_flattened:
                start, stop = piece.flattened_range
                block, mask = whole[region].reshape(-1), written[region].reshape(-1)
                block[start:stop], mask[start:stop] = data.reshape(-1), True
                whole[region], written[region] = block.reshape(piece.local_shape), mask.reshape(piece.local_shape)
            else:
                whole[region], written[region] = data.reshape(piece.local_shape), True
        if not written.all():
            raise FlexCheckpointError(f"{name}: {int((~written).sum())} of {written.size} values are in no saved piece")
        return whole


def is_flex(folder: Path) -> bool:
    """Whether `folder` is a flex checkpoint (or one flex folder of it)."""
    folder = Path(folder)
    return any(folder.glob("*.metadata")) or any(any((folder / part).glob("*.metadata")) for part in FLEX_PARTS)


def flex_parts(folder: Path) -> dict[str, FlexFolder]:
    """The flex folders of a PaddleFormers checkpoint (`model_state` ...; master_weight may be empty),
    or the folder itself when it is one."""
    folder = Path(folder)
    if any(folder.glob("*.metadata")):
        return {folder.name: FlexFolder(folder)}
    parts = {part: FlexFolder(folder / part) for part in FLEX_PARTS if any((folder / part).glob("*.metadata"))}
    if not parts:
        raise FlexCheckpointError(f"{folder} is not a flex checkpoint (no <id>.metadata in it or in "
                                  f"{', '.join(FLEX_PARTS)})")
    return parts


def verify_flex(folder: Path) -> list[str]:
    """Problems of a flex checkpoint: unreadable metadata or pieces, missing files, pieces whose size
    does not fit, tensors not wholly covered. Empty when every tensor assembles."""
    try:
        parts = flex_parts(folder)
    except (FlexCheckpointError, UnsafePickleError, pickle.UnpicklingError, OSError) as err:
        return [str(err)]
    problems = []
    for part, flex in parts.items():
        for name in flex.names():
            try:
                flex.tensor(name)
            except (FlexCheckpointError, UnsafePickleError, pickle.UnpicklingError, OSError) as err:
                problems.append(f"{part}: {err}")
    return problems
