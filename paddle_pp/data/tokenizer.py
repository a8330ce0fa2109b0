"""The SentencePiece tokenizer the repo trains and ships, and its loader.

LLaMA's conventions: byte fallback (no unknown characters), unk=0, bos=1, eos=2, no pad piece.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from checkpoint.format import TOKENIZER_FILE
from paddle_pp.runtime.errors import UserError



class TokenizerError(UserError, FileNotFoundError):
    """The tokenizer model is missing or unreadable."""


def train_tokenizer(corpus: Path, output_dir: Path, vocab_size: int = 4096, seed_sentences: int = 200_000) -> Path:
    """Train a BPE SentencePiece model on `corpus` (one paragraph per line or blank-line separated)
    and write `output_dir/tokenizer.model`; deterministic for a given corpus and vocab size."""
    import sentencepiece as spm

    corpus, output_dir = Path(corpus), Path(output_dir)
    if not corpus.is_file():
        raise TokenizerError(f"corpus {corpus} does not exist")
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
        input_sentence_size=seed_sentences, shuffle_input_sentence=False, num_threads=1,
        split_digits=True, max_sentence_length=1 << 16, minloglevel=2,
    )
    path = output_dir / TOKENIZER_FILE
    path.write_bytes(model.getvalue())
    return path


def load_tokenizer(tokenizer_dir: Path):
    """The SentencePiece processor in `tokenizer_dir`, or an error naming the command that makes one."""
    import sentencepiece as spm

    path = Path(tokenizer_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(
            f"no tokenizer at {path}; train one with `python tools/train_tokenizer.py --corpus <text> "
            f"--output_dir {tokenizer_dir}` or point --tokenizer_dir at a folder holding {TOKENIZER_FILE}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(path.read_bytes())
    except RuntimeError as err:
        raise TokenizerError(f"{path} is not a SentencePiece model ({err}); retrain or restore it") from err
    return processor


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """SHA-256 of the tokenizer model: token files record it so stale ids are never trained on."""
    return hashlib.sha256((Path(tokenizer_dir) / TOKENIZER_FILE).read_bytes()).hexdigest()
