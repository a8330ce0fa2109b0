"""Token ids in a memory-mapped file with a JSON index, cut into packed fixed-length samples.

`preprocess` tokenizes a corpus once (paragraphs are documents, each followed by EOS) and writes
`<prefix>.bin` (uint16 or uint32 ids) and `<prefix>.idx.json` (format, dtype, counts, and the
SHA-256 of the corpus and tokenizer). Both are written to temporary names and renamed, so ranks
that preprocess at once, or a crash half-way, never leave a torn file. `PackedTokens` reads
sample i as ids [i*seq, i*seq + seq + 1): inputs are the first seq ids, labels the last seq.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paddle_pp.data.tokenizer import load_tokenizer, tokenizer_digest
from paddle_pp.runtime.errors import UserError

INDEX_FORMAT = 1


class DataError(UserError, ValueError):
    """Missing, stale or too-small token data."""


def _paths(prefix: Path) -> tuple[Path, Path]:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx.json")


def _atomic_write(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def preprocess(corpus: Path, tokenizer_dir: Path, prefix: Path) -> dict:
    """Tokenize `corpus` into `prefix`.bin/.idx.json and return the index."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise DataError(f"corpus {corpus} does not exist; pass --corpus with a UTF-8 text file")
    sp = load_tokenizer(tokenizer_dir)
    text = corpus.read_text(encoding="utf-8")
    documents = [doc.strip() for doc in text.split("\n\n") if doc.strip()]
    ids: list[int] = []
    for doc in documents:
        ids.extend(sp.encode(doc))
        ids.append(sp.eos_id())
    dtype = "uint16" if sp.vocab_size() <= np.iinfo(np.uint16).max + 1 else "uint32"
    index = {
        "format": INDEX_FORMAT,
        "dtype": dtype,
        "num_tokens": len(ids),
        "num_documents": len(documents),
        "vocab_size": sp.vocab_size(),
        "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokenizer_sha256": tokenizer_digest(tokenizer_dir),
    }
    bin_path, idx_path = _paths(prefix)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(bin_path, np.asarray(ids, dtype=dtype).tobytes())
    _atomic_write(idx_path, json.dumps(index, indent=1).encode())
    return index


def ensure_tokens(corpus: Path, tokenizer_dir: Path, prefix: Path) -> dict:
    """The index of `prefix`, preprocessing first when it is missing or was made from another
    corpus or tokenizer (stale ids would silently train on the wrong vocabulary)."""
    _, idx_path = _paths(prefix)
    if idx_path.is_file():
        index = json.loads(idx_path.read_text())
        fresh = (index.get("format") == INDEX_FORMAT
                 and index.get("tokenizer_sha256") == tokenizer_digest(tokenizer_dir)
                 and index.get("corpus_sha256") == hashlib.sha256(Path(corpus).read_bytes()).hexdigest())
        if fresh:
            return index
    return preprocess(corpus, tokenizer_dir, prefix)


@dataclass(frozen=True)
class PackedTokens:
    """Samples of seq_len + 1 consecutive ids, the last `eval_samples` held out for evaluation."""

    prefix: Path
    seq_len: int
    eval_samples: int

    def __post_init__(self):
        bin_path, idx_path = _paths(self.prefix)
        if not bin_path.is_file() or not idx_path.is_file():
            raise DataError(f"no token data at {bin_path}; run `python tools/preprocess_data.py` first")
        index = json.loads(idx_path.read_text())
        ids = np.memmap(bin_path, dtype=index["dtype"], mode="r")
        if ids.size != index["num_tokens"]:
            raise DataError(f"{bin_path} holds {ids.size} ids but its index says {index['num_tokens']}: "
                            "the file is truncated or stale; delete both files to preprocess again")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "index", index)
        total = (ids.size - 1) // self.seq_len
        if total <= self.eval_samples + 1:
            raise DataError(f"{ids.size} tokens give {total} samples of --max_seq_length {self.seq_len}, "
                            f"too few for {self.eval_samples} held-out samples plus training")
        object.__setattr__(self, "total", total)

    @property
    def num_train(self) -> int:
        # One sample is skipped between the splits: the last training sample's final label is the
        # first id of the next sample, so a gap keeps held-out ids out of training entirely.
        return self.total - self.eval_samples - 1

    def sample(self, i: int, split: str = "train") -> np.ndarray:
        start = (i if split == "train" else self.num_train + 1 + i) * self.seq_len
        return np.asarray(self.ids[start:start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels), each [len(indices), seq_len]."""
        rows = np.stack([self.sample(int(i), split) for i in indices]) if len(indices) else \
            np.zeros([0, self.seq_len + 1], np.int64)
        return rows[:, :-1], rows[:, 1:]
