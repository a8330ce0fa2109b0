"""Tokenizers behind one interface: the SentencePiece model the repo trains and ships; hub folders
with a `tokenizer.json` (Llama 3, Qwen2/3, SmolLM, Mistral, Gemma) and GPT-2 style `vocab.json` +
`merges.txt` folders through Hugging Face's `tokenizers` library (the Rust library transformers'
fast tokenizers are, already installed with PaddleNLP); any other folder PaddleNLP's `AutoTokenizer`
loads offline.

The shipped model follows LLaMA's conventions: byte fallback (no unknown characters), unk=0, bos=1,
eos=2, no pad piece.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.format import TOKENIZER_FILE, tokenizer_files
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


TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class TextTokenizer:
    """What preprocessing, training and generation need from a tokenizer: text to ids (`encode`: no
    special tokens, as PaddleNLP's create_pretraining_data.py makes them), the special ids the folder
    declares around a text (`prefix`: Gemma's `<bos>`, Llama 3's `<|begin_of_text|>`; `suffix`), the
    end-of-document id and the id range."""

    folder: Path
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None
    vocab_size: int
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    # (ids, each id's character span) of a text, special tokens written in it read as such (tokenizer.json only)
    encode_with_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]] | None = None

    def encode_declared(self, text: str) -> list[int]:
        """`text`'s ids as transformers' `tokenizer(text)` gives them: with the folder's special tokens."""
        return [*self.prefix, *self.encode(text), *self.suffix]

    def files(self) -> list[Path]:
        """The folder's tokenizer files (copied into checkpoints)."""
        return tokenizer_files(self.folder)


def tokenizer_digest(folder: Path) -> str:
    """SHA-256 over a folder's tokenizer files, without loading the tokenizer: preprocessed ids
    are named by it, so a changed tokenizer never reuses stale ids."""
    digest = hashlib.sha256()
    for path in tokenizer_files(folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def load_text_tokenizer(tokenizer_dir: Path) -> TextTokenizer:
    """The shipped SentencePiece model when the folder holds only `tokenizer.model`; a folder with a
    `tokenizer.json` (or GPT-2's vocab.json + merges.txt) through `tokenizers`; otherwise the
    folder through PaddleNLP's `AutoTokenizer`, offline."""
    folder = Path(tokenizer_dir)
    if (folder / TOKENIZER_FILE).is_file() and not (folder / TOKENIZER_CONFIG).is_file() \
            and not (folder / FAST_TOKENIZER).is_file():
        sp = load_tokenizer(folder)
        return TextTokenizer(folder, sp.encode, sp.decode, sp.eos_id(), sp.vocab_size())
    if not folder.is_dir() or not any(folder.iterdir()):
        raise TokenizerError(
            f"no tokenizer in {folder}: pass --tokenizer_dir a folder holding {TOKENIZER_FILE} (SentencePiece), "
            f"{FAST_TOKENIZER} (a hub tokenizer) or a tokenizer PaddleNLP's AutoTokenizer loads ({TOKENIZER_CONFIG} "
            f"with its vocabulary files), or train one with `python tools/train_tokenizer.py --corpus <text> "
            f"--output_dir {folder}`")
    settings = _read_json(folder / TOKENIZER_CONFIG)
    if (folder / FAST_TOKENIZER).is_file() or settings.get("tokenizer_class") in BYTE_LEVEL_BPE_CLASSES:
        return _hub_tokenizer(folder, settings)
    tokenizer = _auto_tokenizer(folder)

    def encode(text: str) -> list[int]:
        return tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))

    return TextTokenizer(folder, encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         tokenizer.eos_token_id, len(tokenizer),
                         *_around(tokenizer.build_inputs_with_special_tokens(encode(SENTINEL)), encode(SENTINEL), folder))


FAST_TOKENIZER = "tokenizer.json"
# transformers' slow classes that are GPT-2's byte-level BPE over vocab.json + merges.txt (PaddleNLP
# 3.0.0b4's AutoTokenizer knows none of them by these names)
BYTE_LEVEL_BPE_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path} is not valid JSON ({err})") from err


def _hub_tokenizer(folder: Path, settings: dict) -> TextTokenizer:
    """A hub tokenizer through `tokenizers`: `tokenizer.json` as it is, or vocab.json + merges.txt
    assembled as transformers' GPT-2 conversion does (byte-level pre-tokenizer and decoder). Ids
    come without special tokens, as PaddleNLP's preprocessing makes them; EOS is the folder's
    `eos_token` (tokenizer_config.json, else special_tokens_map.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        if (folder / FAST_TOKENIZER).is_file():
            tokenizer = Tokenizer.from_file(str(folder / FAST_TOKENIZER))
        else:
            tokenizer = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=settings.get("add_prefix_space", False))
            tokenizer.decoder = decoders.ByteLevel()
    except Exception as err:  # the Rust library raises its own exception type for unreadable files
        raise TokenizerError(f"the tokenizer in {folder} cannot be loaded ({type(err).__name__}: {err}); check its "
                             f"{FAST_TOKENIZER} (or vocab.json and merges.txt)") from err
    eos = _special_token(folder, settings, "eos_token")

    def with_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    return TextTokenizer(folder, lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         tokenizer.token_to_id(eos) if eos else None, tokenizer.get_vocab_size(with_added_tokens=True),
                         *_declared_around(tokenizer, folder, settings), encode_with_offsets=with_offsets)


SENTINEL = "a"  # a text whose ids show where a template puts its special tokens


def _declared_around(tokenizer, folder: Path, settings: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special ids around a text, as transformers 5 reads a folder: when tokenizer_config.json names
    `add_bos_token` or `add_eos_token` (Gemma's, LLaMA 2's), or tokenizer.json has no post-processor, those
    two settings; otherwise tokenizer.json's post-processor as it is (Llama 3's template adds
    `<|begin_of_text|>`; Qwen's and GPT-2's byte-level one adds nothing)."""
    if "add_bos_token" in settings or "add_eos_token" in settings or tokenizer.post_processor is None:
        ids = []
        for name in ("bos_token", "eos_token"):
            token = _special_token(folder, settings, name) if settings.get(f"add_{name}") else None
            ids.append((tokenizer.token_to_id(token),) if token and tokenizer.token_to_id(token) is not None else ())
        return ids[0], ids[1]
    return _around(tokenizer.encode(SENTINEL, add_special_tokens=True).ids,
                   tokenizer.encode(SENTINEL, add_special_tokens=False).ids, folder)


def _around(whole: list[int], inner: list[int], folder: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the ids before `inner` in `whole`, the ids after it): what a template adds around a text."""
    for start in range(len(whole) - len(inner) + 1):
        if whole[start:start + len(inner)] == inner:
            return tuple(whole[:start]), tuple(whole[start + len(inner):])
    raise TokenizerError(f"the tokenizer in {folder} changes a text's own ids when it adds its special tokens "
                         f"({inner} became {whole}); such a post-processor is not supported")


def _special_token(folder: Path, settings: dict, name: str) -> str | None:
    """A special token's text (`bos_token`, `eos_token`) from tokenizer_config.json, else special_tokens_map.json."""
    token = settings.get(name) or _read_json(folder / "special_tokens_map.json").get(name)
    return token.get("content") if isinstance(token, dict) else token


def _auto_tokenizer(folder: Path) -> Any:
    from paddlenlp.transformers import AutoTokenizer

    # PaddleNLP's LlamaTokenizer looks for `sentencepiece.bpe.model`; transformers-style folders
    # name the same SentencePiece file `tokenizer.model`.
    named = {"vocab_file": str(folder / TOKENIZER_FILE)} if (folder / TOKENIZER_FILE).is_file() else {}
    try:
        return AutoTokenizer.from_pretrained(str(folder), **named)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise TokenizerError(f"PaddleNLP's AutoTokenizer cannot load {folder} ({type(err).__name__}: {err}); "
                             f"check its {TOKENIZER_CONFIG} and vocabulary files, or give the folder the "
                             f"{FAST_TOKENIZER} transformers' fast tokenizer saves") from err
