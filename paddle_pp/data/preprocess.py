"""Tokenize a corpus into `<prefix>.bin` + `<prefix>.idx`, streaming, in parallel, deterministically.

The main process reads the inputs in order and cuts them into batches of about 1 MB of raw
documents; worker processes parse and tokenize a batch each; results are written in batch order.
At most a few batches per worker are in flight (`multiprocessing.Pool.imap` would read the whole
corpus ahead into its task queue), so memory stays flat in corpus size, and the output bytes do
not depend on `--workers`.

Inputs: JSON lines (`.jsonl`, `.json`, `.jsonl.gz`; the text under `json_key`) and plain text
(`.txt`, `.txt.gz`; documents separated by blank lines). A JSON line without the key is skipped
and counted (the summary says how many); a line that is not JSON fails naming file and line.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import multiprocessing
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from paddle_pp.data.errors import DataError
from paddle_pp.data.indexed_writer import IndexedWriter, prefix_paths, token_dtype
from paddle_pp.data.tokenizer import (
    TextTokenizer,
    load_text_tokenizer,
    tokenizer_digest,
)

BATCH_BYTES = 1 << 20
IN_FLIGHT_PER_WORKER = 4
PREPROCESS_VERSION = 1  # part of the shipped corpus's cache name: bump when the output would change


@dataclass(frozen=True)
class Batch:
    """Raw documents of one input file, from line `first_line` on (for error messages)."""

    path: str
    first_line: int
    kind: str  # "json" or "text"
    documents: list[str]


@dataclass
class Summary:
    prefix: str
    files: int = 0
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    skipped_missing_key: int = 0
    skipped_empty: int = 0
    seconds: float = 0.0
    dtype: str = ""

    def describe(self) -> str:
        rate = self.input_bytes / max(self.seconds, 1e-9) / 2 ** 20
        return (f"{self.documents} documents, {self.tokens} tokens ({self.dtype}) from {self.files} file(s), "
                f"{self.input_bytes / 2 ** 20:.1f} MB in {self.seconds:.1f} s ({rate:.1f} MB/s) -> "
                f"{self.prefix}.bin/.idx; skipped: {self.skipped_missing_key} JSON line(s) without the key, "
                f"{self.skipped_empty} empty document(s)")


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named directly or by glob, in the given order (each glob sorted)."""
    paths: list[Path] = []
    for spec in inputs:
        matches = sorted(glob.glob(spec)) if any(ch in spec for ch in "*?[") else [spec]
        if not matches:
            raise DataError(f"--input {spec} matches no file")
        for match in matches:
            if not Path(match).exists() or Path(match).is_dir():
                raise DataError(f"--input {match} is not a file; pass JSON lines (.jsonl[.gz]) or text (.txt[.gz])")
            paths.append(Path(match))
    return paths


def _kind(path: Path) -> str:
    name = path.name.removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return "json"
    if name.endswith(".txt"):
        return "text"
    raise DataError(f"{path}: unknown input type; use .jsonl/.json (JSON lines) or .txt (blank-line documents), "
                    "optionally .gz")


class _Counted(io.RawIOBase):
    """A raw file that reports the bytes read from disk (also through gzip, also from a pipe)."""

    def __init__(self, handle, progress):
        self.handle, self.progress = handle, progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self.handle.readinto(buffer)
        self.progress(count or 0)
        return count


def _records(path: Path, kind: str, progress) -> Iterator[tuple[int, str]]:
    """(line number, raw document) pairs; `progress` gets the on-disk bytes consumed."""
    with open(path, "rb", buffering=0) as raw:
        stream = io.BufferedReader(_Counted(raw, progress), buffer_size=1 << 20)
        text = io.TextIOWrapper(gzip.open(stream) if path.name.endswith(".gz") else stream, encoding="utf-8")
        paragraph, start = [], 1
        for number, line in enumerate(text, start=1):
            if kind == "json":
                if line.strip():
                    yield number, line
            elif line.strip():
                if not paragraph:
                    start = number
                paragraph.append(line)
            elif paragraph:
                yield start, "".join(paragraph)
                paragraph = []
        if paragraph:
            yield start, "".join(paragraph)


def read_batches(paths: list[Path], progress=lambda n: None) -> Iterator[Batch]:
    for path in paths:
        kind = _kind(path)
        documents: list[str] = []
        size, first = 0, 1
        for number, document in _records(path, kind, progress):
            if not documents:
                first = number
            documents.append(document)
            size += len(document)
            if size >= BATCH_BYTES:
                yield Batch(str(path), first, kind, documents)
                documents, size = [], 0
        if documents:
            yield Batch(str(path), first, kind, documents)


_worker_state: dict = {}


def _init_worker(tokenizer_dir: str, json_key: str, append_eos: bool, add_bos_token: bool) -> None:
    _worker_state.update(tokenizer=load_text_tokenizer(Path(tokenizer_dir)), json_key=json_key, append_eos=append_eos,
                         add_bos_token=add_bos_token)


def encode_batch(batch: Batch) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(ids concatenated, each document's length, JSON lines without the key, empty documents). Each
    document starts with the ids its tokenizer declares before a text (`add_bos_token`) and ends with
    EOS (`append_eos`)."""
    tokenizer: TextTokenizer = _worker_state["tokenizer"]
    key, eos = _worker_state["json_key"], [tokenizer.eos_id] if _worker_state["append_eos"] else []
    bos = list(tokenizer.prefix) if _worker_state["add_bos_token"] else []
    pieces, lengths, missing, empty = [], [], 0, 0
    for offset, raw in enumerate(batch.documents):
        if batch.kind == "json":
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as err:
                raise DataError(f"{batch.path}: line {batch.first_line + offset} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or key not in record:
                missing += 1
                continue
            text = str(record[key]).strip()
        else:
            text = raw.strip()
        ids = tokenizer.encode(text) if text else []
        if not ids:
            empty += 1
            continue
        pieces.append(np.asarray(bos + ids + eos, dtype=np.int64))
        lengths.append(len(bos) + len(ids) + len(eos))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    return ids, np.asarray(lengths, dtype=np.int64), missing, empty


def _encoded(batches: Iterator[Batch], workers: int, init_args: tuple) -> Iterator[tuple]:
    """Encoded batches in input order, at most `IN_FLIGHT_PER_WORKER` per worker ahead."""
    if workers <= 1:
        _init_worker(*init_args)
        yield from map(encode_batch, batches)
        return
    with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(encode_batch, (batch,)))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(inputs: list[str], tokenizer_dir: Path, prefix: Path, json_key: str = "text", workers: int = 1,
               append_eos: bool = True, show_progress: bool = True, add_bos_token: bool = True) -> Summary:
    """Tokenize `inputs` into `prefix`.bin/.idx and return what was done. `add_bos_token`: each document
    begins as the tokenizer begins a text (Gemma's `<bos>`, Llama 3's `<|begin_of_text|>`; nothing for a
    tokenizer that declares nothing, as the shipped one)."""
    paths = expand_inputs(inputs)
    tokenizer = load_text_tokenizer(tokenizer_dir)
    if append_eos and tokenizer.eos_id is None:
        raise DataError(f"the tokenizer in {tokenizer_dir} has no end-of-sequence token; drop --append_eos")
    dtype = token_dtype(tokenizer.vocab_size)
    summary = Summary(prefix=str(prefix), files=len(paths), dtype=dtype.name)
    total = sum(path.stat().st_size for path in paths)
    started = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="tokenizing",
              disable=not show_progress, dynamic_ncols=True) as bar, IndexedWriter(prefix, dtype) as writer:
        def progress(nbytes: int) -> None:
            summary.input_bytes += nbytes
            bar.update(nbytes)

        init_args = (str(tokenizer_dir), json_key, append_eos, add_bos_token)
        for ids, lengths, missing, empty in _encoded(read_batches(paths, progress), workers, init_args):
            writer.add_documents(ids, lengths)
            summary.skipped_missing_key += missing
            summary.skipped_empty += empty
            bar.set_postfix(docs=writer.documents, refresh=False)
        if writer.documents == 0:
            raise DataError(f"no documents in {', '.join(map(str, paths))}"
                            + (f" (no JSON line has the key '{json_key}'; pass --json_key)" if
                               summary.skipped_missing_key else ""))
        writer.commit()
        summary.documents, summary.tokens = writer.documents, writer.tokens
    summary.seconds = time.perf_counter() - started
    return summary


def corpus_prefix(corpus: Path, tokenizer_dir: Path, cache_dir: Path, add_bos_token: bool = True) -> Path:
    """Where the preprocessed `corpus` lives in `cache_dir`: named by a digest of the corpus, the
    tokenizer, whether documents begin with the ids it declares (when it declares some) and this
    preprocessing's version, so changing any of them never reuses stale ids."""
    digest = hashlib.sha256(Path(corpus).read_bytes())
    digest.update(tokenizer_digest(tokenizer_dir).encode() + str(PREPROCESS_VERSION).encode())
    begins = load_text_tokenizer(tokenizer_dir).prefix if add_bos_token else ()
    if begins:  # documents without them keep the name they had before tokenizers declared any
        digest.update(("begins " + " ".join(map(str, begins))).encode())
    return Path(cache_dir) / f"{Path(corpus).stem}-{digest.hexdigest()[:16]}"


def ensure_corpus(corpus: Path, tokenizer_dir: Path, cache_dir: Path, add_bos_token: bool = True) -> Path:
    """The zero-setup path: the prefix of `corpus` preprocessed (documents begun as the tokenizer
    declares, ending in EOS), making it on first use."""
    if not Path(corpus).is_file():
        raise DataError(f"--corpus {corpus} does not exist; pass a UTF-8 text file or --input_dir with "
                        "prepared data (tools/preprocess_data.py)")
    prefix = corpus_prefix(corpus, tokenizer_dir, cache_dir, add_bos_token)
    if not all(path.is_file() for path in prefix_paths(prefix)):
        preprocess([str(corpus)], tokenizer_dir, prefix, append_eos=True, show_progress=False,
                   add_bos_token=add_bos_token)
    return prefix
