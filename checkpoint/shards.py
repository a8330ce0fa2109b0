"""Streaming safetensors shards: the header is written from the planned shapes, then each tensor's
bytes as it arrives, hashing on the way; reads are `safetensors.safe_open` slices.

Streaming keeps a writer's extra memory at one tensor instead of its whole shard, and the bytes
written are a pure function of the tensors, so async and sync saves give identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from checkpoint.format import CheckpointError

DTYPES = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
          np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("uint16"): "U16", np.dtype("uint8"): "U8"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_shard(path: Path, specs: list[TensorSpec], tensors: Iterable[np.ndarray],
                metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write `tensors` (in the order of `specs`) to `path`, fsync it; returns (sha256, size).

    Each tensor is hashed on a helper thread while it is written (hashlib releases the GIL), so
    the checksum costs no extra pass over the data."""
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as handle, ThreadPoolExecutor(max_workers=1) as hasher:
        head = _header(specs, metadata or {})
        handle.write(head)
        digest.update(head)
        size += len(head)
        hashing = None
        for spec, array in zip(specs, tensors, strict=True):
            array = np.ascontiguousarray(array)
            if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
                raise CheckpointError(f"{spec.name}: got {array.dtype}{list(array.shape)}, planned "
                                      f"{spec.dtype}{list(spec.shape)}")
            data = array.view(np.uint8).reshape(-1).data if array.size else b""
            if hashing is not None:
                hashing.result()
            hashing = hasher.submit(digest.update, data)
            handle.write(data)
            size += array.nbytes
        if hashing is not None:
            hashing.result()
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest(), size


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class ShardReader:
    """Slices of tensors in one shard through `safetensors.safe_open`; a damaged file is a clear error."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path} is missing")
        try:
            self._file = safe_open(str(self.path), framework="numpy")
            names = list(self._file.keys())
        except Exception as err:  # safetensors raises its own error types for torn headers
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({err}); it is truncated "
                                  "or corrupted: restore it or resume from an older checkpoint") from err
        self._check_length()
        self.names = set(names)

    def _check_length(self) -> None:
        with open(self.path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        expected, actual = 8 + header_len + end, self.path.stat().st_size
        if actual != expected:
            raise CheckpointError(f"{self.path} holds {actual} bytes but its header describes {expected}: "
                                  "the file is truncated or was overwritten")

    def shape(self, name: str) -> list[int]:
        return list(self._file.get_slice(name).get_shape())

    def read(self, name: str, axis: int | None = None, parts: int = 1, part: int = 0) -> np.ndarray:
        """The whole tensor, or its `part`-th of `parts` equal pieces along `axis`."""
        if name not in self.names:
            raise CheckpointError(f"{self.path} does not hold {name!r}")
        view = self._file.get_slice(name)
        if axis is None or parts == 1:
            return view[:]
        shape = view.get_shape()
        step = shape[axis] // parts
        index = tuple(slice(part * step, (part + 1) * step) if dim == axis else slice(None)
                      for dim in range(len(shape)))
        return view[index]


def iterate_specs(arrays: dict[str, np.ndarray]) -> Iterator[TensorSpec]:
    for name in sorted(arrays):
        yield TensorSpec(name, arrays[name].dtype, tuple(arrays[name].shape))
