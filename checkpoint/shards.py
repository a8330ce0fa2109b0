"""Streaming safetensors shards: the header is written from the planned shapes, then each tensor's
bytes as it arrives, checksummed on the way; reads are positioned reads of whole tensors or TP pieces.

Streaming keeps a writer's extra memory at one tensor instead of its whole shard, and the bytes
written are a pure function of the tensors, so async and sync saves give identical files.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import struct
import threading
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from checkpoint import crc32_ranges
from checkpoint.format import BFLOAT16, CheckpointError
from checkpoint.piece import WHOLE, Piece

DTYPES = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
          BFLOAT16: "BF16", np.dtype("int64"): "I64", np.dtype("int32"): "I32",
          np.dtype("uint16"): "U16", np.dtype("uint8"): "U8"}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what weights can be exported as (ml_dtypes rounds to nearest even)
CODES = {code: dtype for dtype, code in DTYPES.items()}
FLOAT8_E4M3, FLOAT8_CODE = np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3"  # read only: released FP8 weights


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


def shard_layout(specs: list[TensorSpec], metadata: dict[str, str]) -> tuple[dict[str, int], int]:
    """Where each tensor's bytes start in the shard `write_shard` makes of `specs`, and the file's size."""
    offset, starts = len(_header(specs, metadata)), {}
    for spec in specs:
        starts[spec.name] = offset
        offset += spec.nbytes
    return starts, offset


class _Crc32:
    """zlib's CRC-32 behind hashlib's interface (hashlib has no CRC)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def skip(self, nbytes: int) -> None:
        self.value = crc32_ranges.skip(self.value, nbytes)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


CHECKSUM = "crc32"
"""The checksum new files carry, recorded as {"crc32": <hex>, "size": <bytes>} in an index. CRC-32
catches what a checkpoint meets (truncation, torn writes, bit flips; there is no adversary) at disk
speed: SHA-256 hashes about 1 GB/s per core and held saves to 0.63x of bare safetensors on 2 cores."""
DIGESTS = {"crc32": _Crc32, "sha256": hashlib.sha256}  # sha256: files written in format version 1


def file_entry(digest: str, size: int) -> dict:
    """A file's entry in an index's `files`: its checksum and size."""
    return {CHECKSUM: digest, "size": size}


def recorded_checksum(entry: dict) -> tuple[str, str]:
    """(algorithm, hex digest) an index's file entry records."""
    for algorithm in DIGESTS:
        if algorithm in entry:
            return algorithm, entry[algorithm]
    raise CheckpointError(f"a file entry {entry} records no checksum of {sorted(DIGESTS)}: the index is damaged")


class OverlappedDigest:
    """A checksum of a stream of buffers, each summed on a helper thread while the caller reads or
    writes the next (zlib and hashlib release the GIL), so it costs no extra pass over the data.
    A buffer must stay unchanged until the next `update` or `hexdigest` returns."""

    def __init__(self, hasher: ThreadPoolExecutor, algorithm: str = CHECKSUM):
        self.hasher, self.digest, self.pending = hasher, DIGESTS[algorithm](), None

    def update(self, buffer) -> None:
        self._wait()
        self.pending = self.hasher.submit(self.digest.update, buffer)

    def skip(self, nbytes: int) -> None:
        """Continue as if `nbytes` zero bytes came (a range another rank writes; CRC-32 only)."""
        self._wait()
        self.digest.skip(nbytes)

    def hexdigest(self) -> str:
        self._wait()
        return self.digest.hexdigest()

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def pack(names: Iterable[str], nbytes: Callable[[str], int], max_shard_bytes: int) -> list[list[str]]:
    """`names`, in order, cut into shards of at most `max_shard_bytes` (a larger tensor gets a shard
    of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + nbytes(name) > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes(name)
    return groups


class _BufferPool:
    """Page-aligned buffers kept from one file to the next: a fresh buffer's first fill takes a page
    fault per 4 KB, paid per file by every rank of every save. With the pool a 1-process save went
    from 0.89x and 0.96x of bare safetensors (two runs before) to 1.16x and 1.17x (two runs after,
    bench/checkpoint_io.py)."""

    def __init__(self):
        self.free: list[mmap.mmap] = []
        self.lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self.lock:
            for index, buffer in enumerate(self.free):
                if len(buffer) == size:
                    return self.free.pop(index)
        return mmap.mmap(-1, size)

    def give(self, buffer: mmap.mmap) -> None:
        with self.lock:
            self.free.append(buffer)


_BOUNCE_BUFFERS = _BufferPool()


class DirectWriter:
    """A file written front to back with O_DIRECT, through two page-aligned bounce buffers (one
    filled while a helper thread writes the other), then fsynced. Buffered write+fsync of the same
    1 GB took 0.66 to 2.25 s here, the spread all inside write() as the kernel finds page-cache
    pages; O_DIRECT skips the page cache and took 0.78 to 1.02 s (bench/write_stability.py). Where
    a file system refuses O_DIRECT (at open or on a first aligned write), it writes buffered.

    A file other ranks write pieces of (`PieceWriter`; `shared_size` given) is written buffered at
    its final size and never truncated: an O_DIRECT block would overwrite their bytes beside ours."""

    ALIGN = 4096  # O_DIRECT needs block-aligned memory, offsets and lengths
    BUFFER_BYTES = 16 << 20

    def __init__(self, path: Path, shared_size: int | None = None):
        self.path, self.offset, self.fill, self.current = Path(path), 0, 0, 0
        if shared_size is not None:
            self.fd, self.direct = _open_shared(self.path, shared_size), False
        else:
            self.fd, self.direct = self._open_direct(), True
            if self.fd is None:
                self.fd, self.direct = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), False
        self.buffers = [_BOUNCE_BUFFERS.take(self.BUFFER_BYTES) for _ in range(2)] if self.direct else []
        self.writing: list = [None, None]  # each buffer's pending write
        self.writer = ThreadPoolExecutor(max_workers=1) if self.direct else None

    def _open_direct(self) -> int | None:
        """An O_DIRECT descriptor that took one aligned block (some file systems accept the flag at
        open and refuse the writes), or None."""
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        except OSError:
            return None
        probe = mmap.mmap(-1, self.ALIGN)
        try:
            os.pwrite(fd, probe, 0)  # overwritten by the file's first block
            return fd
        except OSError:
            os.close(fd)
            return None
        finally:
            probe.close()

    def write(self, data) -> None:
        source = np.frombuffer(data, np.uint8)
        if not self.direct:
            _pwrite_all(self.fd, source.data, self.offset)
            self.offset += source.size
            return
        done = 0
        while done < source.size:
            if self.fill == 0 and self.writing[self.current] is not None:
                self.writing[self.current].result()  # the buffer's previous write is down
            count = min(self.BUFFER_BYTES - self.fill, source.size - done)
            view = np.frombuffer(self.buffers[self.current], np.uint8)
            view[self.fill:self.fill + count] = source[done:done + count]
            self.fill, done = self.fill + count, done + count
            if self.fill == self.BUFFER_BYTES:
                self._flush(self.BUFFER_BYTES)

    def skip(self, nbytes: int) -> None:
        """Leave `nbytes` to another writer (buffered files only)."""
        assert not self.direct, "an O_DIRECT file is written front to back"
        self.offset += nbytes

    def _flush(self, length: int) -> None:
        self.writing[self.current] = self.writer.submit(
            _pwrite_all, self.fd, memoryview(self.buffers[self.current])[:length], self.offset)
        self.offset, self.fill, self.current = self.offset + self.fill, 0, 1 - self.current

    def close(self) -> None:
        """Write the last partial block (padded, then cut to length), fsync, close."""
        try:
            if self.direct:
                size = self.offset + self.fill
                if self.fill:
                    self._flush(-(-self.fill // self.ALIGN) * self.ALIGN)
                for pending in self.writing:
                    if pending is not None:
                        pending.result()  # raises a failed write
                os.ftruncate(self.fd, size)
            os.fsync(self.fd)
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)
            os.close(self.fd)
            for buffer in self.buffers:
                _BOUNCE_BUFFERS.give(buffer)


class ShardStream:
    """A shard written as its tensors arrive: the header from the planned `specs` first, then each
    tensor `put` in `specs` order (those named in `holes` are left to other ranks, `PieceWriter`),
    checksummed on the way; `finish` fsyncs it and returns its index entry (`file_entry`). With
    holes, the checksum counts them as zeros and the entry lists each hole's bytes to the end of the
    file, for `crc32_ranges.combine`. Use it as a context manager: leaving it closes the file."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None,
                 holes: frozenset[str] = frozenset()):
        self.path, self.specs, self.holes = Path(path), list(specs), holes
        head = _header(self.specs, metadata or {})
        self.total = len(head) + sum(spec.nbytes for spec in self.specs)
        self.size, self.after, self.next = 0, {}, 0
        self.handle = DirectWriter(self.path, self.total if holes else None)
        self.hasher = ThreadPoolExecutor(max_workers=1)
        self.digest = OverlappedDigest(self.hasher)
        self.closed = False
        self._emit(head)
        self._skip_holes()

    def _emit(self, data) -> None:
        self.digest.update(data)
        self.handle.write(data)
        self.size += len(data)

    def _skip_holes(self) -> None:
        while self.next < len(self.specs) and self.specs[self.next].name in self.holes:
            spec = self.specs[self.next]
            self.digest.skip(spec.nbytes)
            self.handle.skip(spec.nbytes)
            self.size += spec.nbytes
            self.after[spec.name] = self.total - self.size
            self.next += 1

    def put(self, array: np.ndarray) -> None:
        """Write the next planned tensor."""
        if self.next == len(self.specs):
            raise CheckpointError(f"{self.path}: more tensors than planned")
        spec, array = self.specs[self.next], np.asarray(array, order="C")  # (ascontiguousarray makes 0-d 1-d)
        if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
            raise CheckpointError(f"{spec.name}: got {array.dtype}{list(array.shape)}, planned "
                                  f"{spec.dtype}{list(spec.shape)}")
        self._emit(array.reshape(-1).view(np.uint8).data if array.size else b"")
        self.next += 1
        self._skip_holes()

    def finish(self) -> dict:
        """Close the file once every planned tensor came; its index entry."""
        if self.next < len(self.specs):
            raise CheckpointError(f"{self.path}: {self.specs[self.next].name} and the tensors after it never came")
        checksum = self.digest.hexdigest()
        self.close()
        return file_entry(checksum, self.size) | ({"holes": self.after} if self.holes else {})

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.hasher.shutdown(wait=True)
            finally:
                self.handle.close()

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def write_shard(path: Path, specs: list[TensorSpec], tensors: Iterable[np.ndarray],
                metadata: dict[str, str] | None = None, holes: frozenset[str] = frozenset()) -> dict:
    """Write `tensors` (in the order of `specs`, those in `holes` left out) to `path` as a
    `ShardStream`; returns its index entry."""
    with ShardStream(path, specs, metadata, holes) as stream:
        for array in tensors:
            stream.put(array)
        return stream.finish()


def _open_shared(path: Path, size: int) -> int:
    """A file several ranks write ranges of: created if absent, set to its final size (every
    writer sets the same size, in any order; nobody truncates another's bytes)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    return fd


class PieceWriter:
    """A rank's TP pieces written straight into their place in the single-card tensor, inside the
    shard file of the rank that owns it, instead of being gathered to that rank. A piece along the
    first axis is one range (one positioned write); along an inner axis it is a run per outer
    index: short runs are copied into a shared mapping of the file in one numpy assignment, long
    ones take a positioned write each (a system call per run is small next to a long run's copy).
    Each file is mapped once, whole, and unmapped at `close`. bench/piece_writes.py, 4 ranks
    writing 0.54 GB of 1 MB tensors in 1 KB runs: 0.59 s so, 1.55 s with a mapping per tensor
    (each unmap of dirty shared pages is dear), 1.12 s with a write per run, against 0.51 s for
    contiguous files of their own (every page is faulted in by both ranks). Each piece returns its
    CRC-32 state (`crc32_ranges.piece_state`) for the owner's checksum. Each rank fsyncs what it wrote when it
    is done (deferring every fsync until all ranks had written, so that no shared page goes out
    twice, cost a collective and measured no faster: 1.3-1.6 s against 1.3-1.5 s per tp2 x pp2 save)."""

    MAPPED_RUN_BYTES = 16 << 10  # shorter runs go through the mapping

    def __init__(self):
        self.fds: dict[Path, int] = {}
        self.maps: dict[Path, mmap.mmap | None] = {}  # None: no blocks allocated up front, or mapping refused
        self.nbytes = 0

    def write(self, path: Path, file_size: int, offset: int, shape: tuple[int, ...], where: Piece,
              piece: np.ndarray) -> int:
        """Write `piece`, the TP piece `where` of the tensor of single-card `shape` stored from
        `offset` in `path` (a shard of `file_size` bytes)."""
        if path not in self.fds:
            self.fds[path] = _open_shared(path, file_size)
        fd, piece, axis = self.fds[path], np.ascontiguousarray(piece), where.axis
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        length = outer * shape[axis] * int(np.prod(shape[axis + 1:], dtype=np.int64)) * piece.itemsize
        run, stride = piece.nbytes // max(outer, 1), length // max(outer, 1)
        runs = piece.reshape(-1).view(np.uint8).reshape(outer, run)
        lead = where.part * run
        mapped = outer > 1 and run < self.MAPPED_RUN_BYTES and self._mapped_copy(path, file_size, offset, runs,
                                                                                 stride, lead)
        if not mapped:  # one range, long runs, or a file system without shared writable mappings
            for index, row in enumerate(runs):
                _pwrite_all(fd, row.data, offset + index * stride + lead)
        self.nbytes += piece.nbytes
        return crc32_ranges.piece_state(runs, stride, lead, length)

    def _mapped_copy(self, path: Path, file_size: int, offset: int, runs: np.ndarray, stride: int, lead: int) -> bool:
        """Copy the runs through the file's shared mapping; False where there is none (`_map`)."""
        if path not in self.maps:
            self.maps[path] = self._map(path, file_size)
        if self.maps[path] is None:
            return False
        view = np.frombuffer(self.maps[path], np.uint8, len(runs) * stride, offset).reshape(len(runs), stride)
        view[:, lead:lead + runs.shape[1]] = runs
        return True

    def _map(self, path: Path, file_size: int) -> mmap.mmap | None:
        """The whole file mapped shared, its blocks allocated first: a write through a mapping that
        finds the disk full kills the process with SIGBUS, where fallocate reports ENOSPC as an
        error. None (a write per run instead) where blocks cannot be allocated up front or the file
        system refuses the mapping."""
        error = _fallocate(self.fds[path], file_size)
        if error in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(error, f"no space left for {path} ({file_size} bytes): free space or save elsewhere; "
                                 "the last checkpoint is untouched")
        if error:
            return None
        try:
            return mmap.mmap(self.fds[path], file_size)
        except OSError:
            return None

    def close(self) -> None:
        """Unmap, fsync and close every file written."""
        for mapped in self.maps.values():
            if mapped is not None:
                mapped.close()
        self.maps = {}
        for fd in self.fds.values():
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.fds = {}


@lru_cache(maxsize=1)
def _libc_fallocate():
    """Linux's fallocate(2), or None. Not os.posix_fallocate: where a file system lacks fallocate,
    glibc emulates it by writing zeros, which could land on bytes a peer already wrote."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


def _fallocate(fd: int, size: int) -> int:
    """Allocate the blocks of bytes [0, size) of `fd`: 0, or the errno (EOPNOTSUPP without fallocate)."""
    function = _libc_fallocate()
    if function is None:
        return errno.EOPNOTSUPP
    return 0 if function(fd, 0, 0, size) == 0 else ctypes.get_errno()


def _pwrite_all(fd: int, buffer, offset: int) -> None:
    done = 0
    while done < len(buffer):
        done += os.pwrite(fd, buffer[done:], offset + done)


def file_checksum(path: Path, algorithm: str, chunk: int = 1 << 24) -> str:
    digest = DIGESTS[algorithm]()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class ShardReader:
    """Tensors, or equal pieces of them along an axis, read from one shard with positioned reads into
    fresh arrays. No mmap: a reader's resident memory is what it returns (mapped pages of a large
    shard would count in RSS), and a damaged file is a clear error when opened."""

    BLOCK_BYTES = 64 << 20  # a piece along an inner axis is cut out of blocks of whole rows this large

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path} is missing")
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                if header_len > size - 8:
                    raise ValueError(f"header of {header_len} bytes in a file of {size}")
                header = json.loads(handle.read(header_len))
            self.metadata: dict[str, str] = header.get("__metadata__") or {}  # e.g. {"format": "pt"}
            self._entries = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((v["data_offsets"][1] for v in self._entries.values()), default=0)
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{self.path} is not a readable safetensors file ({err}); it is truncated "
                                  "or corrupted: restore it or resume from an older checkpoint") from err
        self._data_start = 8 + header_len
        if size != self._data_start + end:
            raise CheckpointError(f"{self.path} holds {size} bytes but its header describes {self._data_start + end}: "
                                  "the file is truncated or was overwritten")
        self.names = set(self._entries)
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self._entries:
            raise CheckpointError(f"{self.path} does not hold {name!r}")
        return self._entries[name]

    def _read_into(self, array: np.ndarray, offset: int) -> None:
        buffer, done = memoryview(array).cast("B"), 0
        while done < len(buffer):
            count = os.preadv(self._fd, [buffer[done:]], offset + done)
            if count == 0:
                raise CheckpointError(f"{self.path} ended early: the file is truncated")
            done += count

    def scan(self, wanted: dict[str, Piece], deliver: Callable[[str, np.ndarray], None],
             hasher: ThreadPoolExecutor | None = None, algorithm: str = CHECKSUM,
             into: dict[str, np.ndarray] | None = None, chunk: int = 16 << 20) -> str | None:
        """Read the file once, front to back: each wanted tensor (name -> its `Piece`, as in `read`)
        is written into its array in `into` when one of its dtype and size is there, or else
        passed to `deliver`; with a `hasher`, every byte is summed on it while the next is read, and
        the file's `algorithm` checksum is returned. Reading whole tensors in file order is what lets
        a verified load read each file once instead of once to check and again to slice; without a
        `hasher`, a piece is read alone (`read`)."""
        digest = OverlappedDigest(hasher, algorithm) if hasher is not None else None
        head = np.empty(self._data_start, np.uint8)
        self._read_into(head, 0)
        if digest is not None:
            digest.update(head)
        for name, entry in sorted(self._entries.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = (self._data_start + offset for offset in entry["data_offsets"])
            if name in wanted:
                piece = wanted[name]
                target = _fits((into or {}).get(name), entry, piece)
                split = piece.split
                if digest is None and split:
                    array = self.read(name, piece, out=target)
                else:
                    whole = target.reshape(entry["shape"]) if target is not None and not split else \
                        np.empty(entry["shape"], _stored_dtype(entry["dtype"]))
                    self._read_into(whole, begin)
                    if digest is not None:
                        digest.update(whole.reshape(-1).view(np.uint8))
                    array = piece.flat_slice(self._decode(entry, piece.cut(whole)))
                    if target is not None and split:
                        target.reshape(array.shape)[...] = array
                if target is None:
                    deliver(name, np.asarray(array, order="C"))
            elif digest is not None:
                for first in range(begin, end, chunk):
                    block = np.empty(min(chunk, end - first), np.uint8)
                    self._read_into(block, first)
                    digest.update(block)
        return digest.hexdigest() if digest is not None else None

    @staticmethod
    def _decode(entry: dict, array: np.ndarray) -> np.ndarray:
        """Stored bits as numpy computes with them: bfloat16 and float8 (e4m3) widened exactly to float32."""
        if entry["dtype"] == "BF16":
            return bf16_to_float32(array)
        return array.view(FLOAT8_E4M3).astype(np.float32) if entry["dtype"] == FLOAT8_CODE else array

    def stored_dtype(self, name: str) -> np.dtype:
        """The dtype the tensor is stored in (bfloat16 as ml_dtypes' bfloat16). A float8 one is refused:
        it is read only to be dequantized, and safetensors files here are never written in it."""
        code = self._entry(name)["dtype"]
        if code == FLOAT8_CODE:
            raise CheckpointError(f"{self.path}: {name} is float8, which paddle-pp reads only to dequantize")
        return BFLOAT16 if code == "BF16" else CODES[code]

    def read_stored(self, name: str) -> np.ndarray:
        """The tensor as stored, bit for bit: a tensor carried, not computed with."""
        entry, dtype = self._entry(name), self.stored_dtype(name)
        out = np.empty(entry["shape"], _stored_dtype(entry["dtype"]))
        self._read_into(out, self._data_start + entry["data_offsets"][0])
        return out.view(dtype)

    def read(self, name: str, piece: Piece = WHOLE, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's `piece` (the whole tensor by default); read into `out` when given (an array of
        the stored dtype and the TP piece's size). A stage3 slice is cut from its TP piece once read."""
        entry = self._entry(name)
        shape, dtype = list(entry["shape"]), _stored_dtype(entry["dtype"])
        start = self._data_start + entry["data_offsets"][0]
        if not piece.split:
            out = np.empty(shape, dtype) if out is None else out.reshape(shape)
            self._read_into(out, start)
            return piece.flat_slice(self._decode(entry, out))
        axis, parts, part = piece.axis, piece.parts, piece.part
        outer, dim = int(np.prod(shape[:axis], dtype=np.int64)), shape[axis]
        inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
        step = dim // parts
        piece_shape = shape[:axis] + [step] + shape[axis + 1:]
        out = np.empty(piece_shape, dtype) if out is None else out.reshape(piece_shape)
        if outer == 1:
            self._read_into(out, start + part * step * inner * dtype.itemsize)
        else:
            rows = out.reshape(outer, step * inner)
            row_bytes = dim * inner * dtype.itemsize
            per_block = max(1, self.BLOCK_BYTES // max(row_bytes, 1))
            for first in range(0, outer, per_block):
                block = np.empty((min(per_block, outer - first), dim * inner), dtype)
                self._read_into(block, start + first * row_bytes)
                rows[first:first + len(block)] = block[:, part * step * inner:(part + 1) * step * inner]
        return piece.flat_slice(self._decode(entry, out))


def _stored_dtype(code: str) -> np.dtype:
    """The numpy dtype a tensor's bytes are read as (bfloat16 as its raw uint16 bits, float8 as uint8:
    numpy's buffers take neither)."""
    return {"BF16": np.dtype(np.uint16), FLOAT8_CODE: np.dtype(np.uint8)}.get(code) or CODES[code]


def _fits(target: np.ndarray | None, entry: dict, piece: Piece) -> np.ndarray | None:
    """`target` when the wanted piece's bytes can be read into it as they are stored (a stage3
    slice never: it is cut from its TP piece after the read)."""
    if target is None or piece.flat is not None or entry["dtype"] in ("BF16", FLOAT8_CODE) \
            or target.dtype != CODES[entry["dtype"]]:
        return None
    whole = int(np.prod(entry["shape"], dtype=np.int64))
    return target if target.size == (whole // piece.parts if piece.split else whole) else None


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 held as its raw uint16 bits (numpy has no bfloat16) widened exactly to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
