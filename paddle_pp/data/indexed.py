"""Prepared token files (`<prefix>.bin` + `<prefix>.idx`, MMapIndexedDataset format) checked before
use: both files present, the index well-formed, the data file as long as the index says, and every
token id below the model's vocabulary. The cheap checks read only the index header and run on
every rank before any process group exists; the id scan reads the whole data file once and is
cached by file identity."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint.durable import replaced_when_written
from paddle_pp.data.errors import DataError
from paddle_pp.data.indexed_writer import (
    DTYPE_CODES,
    INDEX_MAGIC,
    INDEX_VERSION,
    prefix_paths,
)

SCAN_CHUNK = 64 << 20  # bytes per chunk of the token-id scan
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_HEADER = len(INDEX_MAGIC) + 8 + 1 + 8 + 8


@dataclass(frozen=True)
class IndexHeader:
    prefix: Path
    dtype: np.dtype
    documents: int


def read_header(prefix: Path) -> IndexHeader:
    """The prefix's index, checked against its data file, or a DataError naming the file and the fix."""
    bin_path, idx_path = prefix_paths(prefix)
    for path, other in ((idx_path, bin_path), (bin_path, idx_path)):
        if not path.is_file():
            raise DataError(f"{path} is missing (found {other.name}: {other.is_file()}); prepared data is a pair "
                            f"<prefix>.bin + <prefix>.idx: rerun tools/preprocess_data.py --output_prefix {prefix}")
    with open(idx_path, "rb") as handle:
        head = handle.read(_HEADER)
    if len(head) < _HEADER or head[:len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise DataError(f"{idx_path} is not an MMapIndexedDataset index (bad magic); --data_impl mmap reads the "
                        ".idx files tools/preprocess_data.py and PaddleNLP's create_pretraining_data.py write")
    version, code, items, doc_entries = struct.unpack("<QBQQ", head[len(INDEX_MAGIC):])
    if version != INDEX_VERSION or code not in _DTYPES:
        raise DataError(f"{idx_path}: unsupported index version {version} or dtype code {code}")
    dtype = _DTYPES[code]
    if idx_path.stat().st_size < _HEADER + items * (4 + 8) + doc_entries * 8:
        raise DataError(f"{idx_path} is truncated ({idx_path.stat().st_size} bytes for {items} documents); "
                        "rerun the preprocessing")
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    sizes = np.frombuffer(index, dtype=np.int32, count=items, offset=_HEADER)
    pointers = np.frombuffer(index, dtype=np.int64, count=items, offset=_HEADER + 4 * items)
    expected = int(pointers[-1]) + int(sizes[-1]) * dtype.itemsize if items else 0
    actual = bin_path.stat().st_size
    if actual != expected:
        raise DataError(f"{bin_path} holds {actual} bytes but {idx_path.name} describes {expected} "
                        f"({items} documents, {int(sizes.sum(dtype=np.int64))} {dtype.name} tokens): the pair is "
                        "truncated or from different runs; rerun the preprocessing")
    return IndexHeader(Path(prefix), dtype, items)


def max_token_id(header: IndexHeader, cache_dir: Path) -> int:
    """The largest id in the data file, scanned once per file version (size, mtime) and cached."""
    bin_path, _ = prefix_paths(header.prefix)
    stat = bin_path.stat()
    key = hashlib.md5(f"{bin_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = Path(cache_dir) / f"{key}_max_token_id.json"
    if cached.is_file():
        with contextlib.suppress(ValueError, KeyError):
            return int(json.loads(cached.read_text())["max_token_id"])
    ids = np.memmap(bin_path, mode="r", dtype=header.dtype)
    step = SCAN_CHUNK // header.dtype.itemsize
    largest = max((int(ids[start:start + step].max()) for start in range(0, ids.size, step)), default=-1)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_written(cached) as staged:
        staged.write_text(json.dumps({"file": str(bin_path), "max_token_id": largest}))
    return largest


def check_vocabulary(header: IndexHeader, vocab_size: int, cache_dir: Path) -> None:
    largest = max_token_id(header, cache_dir)
    if largest >= vocab_size:
        raise DataError(f"{prefix_paths(header.prefix)[0]} holds token id {largest}, not below the model's vocabulary "
                        f"of {vocab_size}: the data was tokenized with another tokenizer; pass that tokenizer's "
                        "folder as --tokenizer_dir, or preprocess again with this one")


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """PaddleNLP's dataset code (and its C++ index helpers, through file descriptor 1) prints
    progress on every rank; keep the job's log readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(io.StringIO()):
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def open_indexed(prefix: Path):
    """PaddleNLP's MMapIndexedDataset over the prefix (its progress prints silenced)."""
    from paddlenlp.data.indexed_dataset import MMapIndexedDataset

    with quiet_stdout():
        return MMapIndexedDataset(str(prefix), skip_warmup=True)
