"""What rank 0 shows and keeps: a progress bar (tqdm) and `metrics.jsonl` (`loss_plot.py` draws
`loss.svg` from it at the end); and the byte-progress bar of the offline checkpoint tools."""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm


def training_bar(max_steps: int, first_step: int) -> tqdm:
    """The training progress bar: steps done of `max_steps` (a resumed run starts at its step), ETA,
    and the latest loss, lr and tokens/s as postfix fields."""
    return tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True)


@contextmanager
def tensor_progress(total_bytes: int, description: str) -> Iterator[Callable[[str, int], None]]:
    """The `on_tensor(name, nbytes)` callback of the checkpoint tools, drawing MB done, MB/s and ETA."""
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=description,
              mininterval=0.5) as bar:
        yield lambda name, nbytes: bar.update(nbytes)
        bar.update(max(0, bar.total - bar.n))  # the total counts whole files (headers, small files): done is 100%


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step, flushed so a crash keeps them.

    Opened by a run resumed at `resume_step`, it first rewrites the file (atomically) without the
    records of later steps, which the resumed run trains again, and without lines torn by a kill,
    so every step appears once, in order, and nothing is appended to a torn line. A fresh run
    (`resume_step` 0) starts the file empty."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept, self.torn_lines, self.superseded = [], 0, 0
        if resume_step and self.path.is_file():
            records, self.torn_lines = parse_metrics(self.path.read_text())
            kept = [record for record in records if record.get("step", 0) <= resume_step]
            self.superseded = len(records) - len(kept)
        staged = self.path.with_name(f".{self.path.name}.tmp")
        staged.write_text("".join(json.dumps(record) + "\n" for record in kept))
        os.replace(staged, self.path)
        self.handle = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


SCALAR_TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
               "tokens_per_sec": "train/tokens_per_second", "eval_loss": "eval/loss", "aux_loss": "train/aux_loss",
               "mtp_loss": "train/mtp_loss", "indexer_loss": "train/indexer_loss"}


class VisualDLLog:
    """The scalars of metrics.jsonl as VisualDL records (`--report_to visualdl`), under the tags of
    PaddleNLP's VisualDL callback where it has one. A resumed run starts a new record file in the
    same folder; VisualDL shows both, the later one from the resumed step."""

    def __init__(self, folder: Path):
        from visualdl import LogWriter

        self.writer = LogWriter(logdir=str(folder))

    def write(self, record: dict) -> None:
        for key, tag in SCALAR_TAGS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag=tag, value=float(record[key]), step=record["step"])

    def close(self) -> None:
        self.writer.close()


def parse_metrics(text: str) -> tuple[list[dict], int]:
    """(records, number of torn lines): a kill mid-write leaves at most a torn last line, which
    is not JSON; it is skipped, never fatal."""
    records, torn = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    return records, torn


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, warning about (and skipping) lines torn by a kill."""
    records, torn = parse_metrics(Path(path).read_text())
    if torn:
        warnings.warn(f"{path}: skipped {torn} torn line(s) left by a killed run", stacklevel=2)
    return records
