"""Fine-tuning rows from chat data: samples rendered, tokenized, labelled, mixed, truncated and packed.

Each JSON line is a sample (`chat.conversation`), rendered by the model's template; its ids are
what transformers' `apply_chat_template` gives, its labels the next token where that token is
trained (-100 elsewhere), shifted inside the sample so no target crosses into another. Several
sources are mixed by probability (PaddleFormers' `train_dataset_path` / `train_dataset_prob`): each
sample of the stream is drawn from a source chosen by the seeded generator, each source read in a
shuffled order that is reshuffled when it runs out.

A sample longer than a row is handled by the recipe's `truncation_strategy`: `delete` (dropped,
PaddleFormers' default), `right` (its first tokens kept) or `left` (its last); the counts go in the
run's notes. Without packing a row is one sample and padding (labels -100). With packing, samples
are bin-packed (first fit, longest first, over windows of the stream) into rows of `seq_length`
tokens and each keeps its own positions, from 0: the per-document attention of the model keeps each
sample to itself, so a packed row trains as its samples one at a time.

Rows are a pure function of (sources, template, tokenizer, seq_length, packing, seed): every rank
builds the same, and a resumed run reads the rows an uninterrupted one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modeling.loss import IGNORE_INDEX
from paddle_pp.data.chat import ChatTemplate, conversation, load_template, special_tokens
from paddle_pp.data.errors import DataError
from paddle_pp.data.tokenizer import TextTokenizer

TRUNCATIONS = ("delete", "right", "left")
PACKING_WINDOW = 512  # samples bin-packed together (longest first), in stream order


@dataclass(frozen=True)
class Sample:
    """One rendered sample: its input ids and labels (equal lengths: the ids but the last, the labels
    the next ids where trained)."""

    inputs: np.ndarray  # int64
    labels: np.ndarray  # int64, IGNORE_INDEX where untrained

    def __len__(self) -> int:
        return len(self.inputs)


@dataclass(frozen=True)
class SFTPlan:
    """What a fine-tuning run reads, checked on every rank before any process group."""

    train_paths: tuple[Path, ...]
    train_probs: tuple[float, ...]
    eval_paths: tuple[Path, ...]
    chat_template: Path | None
    seq_length: int
    packing: bool
    truncation: str
    seed: int
    num_samples: tuple[int, int]


def plan_sft(train_path: str, train_prob: str, eval_path: str, chat_template: str, seq_length: int, packing: bool,
             truncation: str, seed: int, num_samples: tuple[int, int]) -> SFTPlan:
    """PaddleFormers' comma lists read and checked: files exist, one probability per source."""
    train = tuple(Path(p.strip()) for p in train_path.split(",") if p.strip())
    evaluation = tuple(Path(p.strip()) for p in eval_path.split(",") if p.strip())
    for path in (*train, *evaluation):
        if not path.is_file():
            raise DataError(f"dataset {path} does not exist (a JSON-lines file of chat samples)")
    probs = tuple(float(p) for p in train_prob.split(",") if p.strip()) if train_prob.strip() else (1.0,) * len(train)
    if len(probs) != len(train) or any(p <= 0 for p in probs):
        raise DataError(f"--train_dataset_prob '{train_prob}': one positive probability per --train_dataset_path "
                        f"source ({len(train)})")
    if truncation not in TRUNCATIONS:
        raise DataError(f"--truncation_strategy {truncation!r} is not modelled; use one of {TRUNCATIONS}")
    return SFTPlan(train, tuple(p / sum(probs) for p in probs), evaluation,
                   Path(chat_template) if chat_template else None, seq_length, packing, truncation, seed, num_samples)


class SampleEncoder:
    """Conversations to `Sample`s by the model's template and tokenizer."""

    def __init__(self, tokenizer: TextTokenizer, template_path: Path | None = None):
        if tokenizer.encode_with_offsets is None:
            raise DataError(f"fine-tuning on chat data maps the template's assistant turns to tokens through "
                            f"tokenizer.json's offsets; {tokenizer.folder} has no tokenizer.json")
        source, name = load_template(tokenizer.folder, template_path)
        self.template = ChatTemplate(source, special_tokens(tokenizer.folder), name)
        self.tokenizer = tokenizer

    def ids_and_mask(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(the ids apply_chat_template gives, which of them train)."""
        text, spans = self.template.trained_spans(conversation(record, where), where)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        trained = np.zeros(len(ids), bool)
        for start, end in spans:
            trained |= np.array([s < end and e > start for s, e in offsets], bool)
        return np.asarray(ids, np.int64), trained

    def sample(self, record: dict, where: str) -> Sample:
        ids, trained = self.ids_and_mask(record, where)
        return Sample(ids[:-1], np.where(trained[1:], ids[1:], IGNORE_INDEX))


def read_samples(path: Path, encoder: SampleEncoder) -> list[Sample]:
    samples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not a JSON line ({err})") from err
            samples.append(encoder.sample(record, f"{path}:{number}"))
    if not samples:
        raise DataError(f"{path} holds no sample")
    return samples


def truncated(sample: Sample, length: int, strategy: str) -> Sample | None:
    """`sample` fitted to `length` tokens by `strategy` (None: dropped, or nothing left to train)."""
    if len(sample) > length:
        if strategy == "delete":
            return None
        kept = slice(0, length) if strategy == "right" else slice(len(sample) - length, None)
        sample = Sample(sample.inputs[kept], sample.labels[kept])
    return sample if (sample.labels != IGNORE_INDEX).any() else None


@dataclass
class SFTRows:
    """Rows of `seq_length` tokens, each a list of samples (one without packing)."""

    rows: list[list[Sample]]
    seq_length: int
    pad_id: int
    packed: bool
    notes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(inputs, labels, positions inside each sample; None without packing) of rows `indices`
        (taken modulo the rows built)."""
        count, length = len(indices), self.seq_length
        inputs = np.full((count, length), self.pad_id, np.int64)
        labels = np.full((count, length), IGNORE_INDEX, np.int64)
        positions = np.zeros((count, length), np.int64)
        for row, index in enumerate(indices):
            at = 0
            for sample in self.rows[int(index) % len(self.rows)]:
                inputs[row, at:at + len(sample)], labels[row, at:at + len(sample)] = sample.inputs, sample.labels
                positions[row, at:at + len(sample)] = np.arange(len(sample))
                at += len(sample)
            positions[row, at:] = np.arange(length - at)  # the padding: one more document, never trained
        return inputs, labels, positions if self.packed else None


def build_rows(plan: SFTPlan, encoder: SampleEncoder, pad_id: int, paths: tuple[Path, ...], probs: tuple[float, ...],
               wanted: int) -> SFTRows:
    """`wanted` rows (at least one) of samples drawn from `paths` by `probs`."""
    sources, notes = [], []
    for path in paths:
        read = read_samples(path, encoder)
        samples = [kept for kept in (truncated(sample, plan.seq_length, plan.truncation) for sample in read)
                   if kept is not None]
        cut = sum(len(sample) > plan.seq_length for sample in read)
        if cut or len(samples) < len(read):
            notes.append(f"{path}: {cut} of {len(read)} samples longer than --max_seq_length {plan.seq_length} "
                         f"(--truncation_strategy {plan.truncation}); {len(read) - len(samples)} dropped")
        if not samples:
            raise DataError(f"{path}: no sample fits --max_seq_length {plan.seq_length} with something to train "
                            f"(--truncation_strategy {plan.truncation}); raise it, or truncate left or right")
        sources.append(samples)
    rng = np.random.RandomState(plan.seed)
    orders = [[] for _ in sources]
    rows: list[list[Sample]] = []

    def draw() -> Sample:
        source = int(rng.choice(len(sources), p=probs)) if len(sources) > 1 else 0
        if not orders[source]:
            orders[source] = list(rng.permutation(len(sources[source])))
        return sources[source][orders[source].pop()]

    target = max(wanted, 1)
    while len(rows) < target:
        window = [draw() for _ in range(PACKING_WINDOW if plan.packing else 1)]
        rows += _packed(window, plan.seq_length) if plan.packing else [window]
    return SFTRows(rows[:target], plan.seq_length, pad_id, plan.packing, tuple(notes))


def _packed(samples: list[Sample], length: int) -> list[list[Sample]]:
    """First fit, longest first: each sample into the first row with room."""
    rows: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=len, reverse=True):
        fits = next((i for i, free in enumerate(room) if free >= len(sample)), None)
        if fits is None:
            rows.append([sample])
            room.append(length - len(sample))
        else:
            rows[fits].append(sample)
            room[fits] -= len(sample)
    return rows


def build_sft(plan: SFTPlan, tokenizer: TextTokenizer) -> tuple[SFTRows, SFTRows | None]:
    """(train rows, eval rows or None without --eval_dataset_path)."""
    encoder = SampleEncoder(tokenizer, plan.chat_template)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    train = build_rows(plan, encoder, pad, plan.train_paths, plan.train_probs, plan.num_samples[0])
    valid = build_rows(plan, encoder, pad, plan.eval_paths, (1.0 / len(plan.eval_paths),) * len(plan.eval_paths),
                       plan.num_samples[1]) if plan.eval_paths else None
    return train, valid
