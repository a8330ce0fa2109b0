"""Writes `<prefix>.bin` + `<prefix>.idx` in the MMapIndexedDataset format PaddleNLP and Megatron-LM
read (one item per document), in memory that does not grow with the corpus.

PaddleNLP's `MMapIndexedDatasetBuilder` keeps every document's size in a Python list and builds the
pointer list in Python at the end (about 70 bytes per document: gigabytes for a corpus of tens of
millions of documents). Here sizes go to a side file as int32 while the ids stream to disk, and the
index is written in chunks. Nothing appears under the final names until the index is complete:
an interrupted run leaves only hidden temporary files, which the next run replaces.

Layout of `.idx`: magic, version (u64 = 1), dtype code (u8), item count (u64), document count
(u64), sizes (int32 per item), byte pointers (int64 per item), document index (int64, count + 1).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from checkpoint.durable import fsync_dir

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8,
               np.dtype(np.uint32): 9, np.dtype(np.uint64): 10}
CHUNK = 1 << 20  # items per chunk when writing the index


def prefix_paths(prefix: Path) -> tuple[Path, Path]:
    """(`<prefix>.bin`, `<prefix>.idx`)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def token_dtype(vocab_size: int) -> np.dtype:
    """PaddleNLP's choice (create_pretraining_data.py): uint16 below 65535 ids, int32 above."""
    return np.dtype(np.uint16 if vocab_size < 2 ** 16 - 1 else np.int32)


def _hidden(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{suffix}")


def _fsync(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())


class IndexedWriter:
    """Append documents, then `commit()`; leaving the `with` block by an exception removes every
    temporary file and leaves the final names untouched."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.bin_path, self.idx_path = prefix_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._temps = [_hidden(self.bin_path, "tmp"), _hidden(self.idx_path, "tmp"), _hidden(self.idx_path, "sizes")]
        self._bin, self._sizes = open(self._temps[0], "wb"), open(self._temps[2], "w+b")
        self.documents = 0
        self.tokens = 0

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._bin.close()
        self._sizes.close()
        for path in self._temps:
            path.unlink(missing_ok=True)

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their ids concatenated and each one's length."""
        self._bin.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self._sizes.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))

    def commit(self) -> None:
        _fsync(self._bin)
        self._bin.close()
        self._sizes.flush()
        self._sizes.seek(0)
        with open(self._temps[1], "wb") as idx:
            idx.write(INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[self.dtype]))
            idx.write(struct.pack("<Q", self.documents) + struct.pack("<Q", self.documents + 1))
            for chunk in self._size_chunks():
                idx.write(chunk.tobytes())
            address = 0
            self._sizes.seek(0)
            for chunk in self._size_chunks():
                ends = address + np.cumsum(chunk, dtype=np.int64) * self.dtype.itemsize
                idx.write(np.concatenate([[address], ends[:-1]]).astype(np.int64).tobytes())
                address = int(ends[-1])
            for start in range(0, self.documents + 1, CHUNK):
                idx.write(np.arange(start, min(start + CHUNK, self.documents + 1), dtype=np.int64).tobytes())
            _fsync(idx)
        os.replace(self._temps[0], self.bin_path)
        os.replace(self._temps[1], self.idx_path)
        fsync_dir(self.bin_path.parent)

    def _size_chunks(self):
        while True:
            chunk = np.frombuffer(self._sizes.read(CHUNK * 4), dtype=np.int32)
            if chunk.size == 0:
                return
            yield chunk
