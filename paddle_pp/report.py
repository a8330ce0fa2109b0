"""What rank 0 shows and keeps: a progress bar, `metrics.jsonl`, and `loss.png` at the end; and
the byte-progress bar of the offline checkpoint tools."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO


class ProgressBar:
    """One self-overwriting line: step, loss, lr, tokens/s and ETA (plain lines when not a TTY)."""

    def __init__(self, total_steps: int, first_step: int = 0, stream: TextIO = sys.stderr, width: int = 24):
        self.total, self.first, self.stream, self.width = total_steps, first_step, stream, width
        self.started = time.monotonic()
        self.interactive = stream.isatty()

    def update(self, step: int, values: dict[str, float]) -> None:
        elapsed = time.monotonic() - self.started
        done = step - self.first
        eta = elapsed / done * (self.total - step) if done else 0.0
        filled = min(self.width, int(self.width * step / max(self.total, 1)))
        fields = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} {fields} eta {eta:.0f}s"
        self.stream.write(("\r" + line) if self.interactive else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


class TensorProgress:
    """The `on_tensor(name, nbytes)` callback of the checkpoint tools: megabytes done and MB/s,
    redrawn at most every `interval` seconds (a tool visits thousands of tensors)."""

    def __init__(self, total_bytes: int, stream: TextIO = sys.stderr, interval: float = 0.5):
        self.bar = ProgressBar(max(1, total_bytes >> 20), stream=stream)
        self.done, self.interval, self.shown = 0, interval, 0.0

    def __call__(self, name: str, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.shown >= self.interval:
            self.shown = now
            megabytes = self.done / 2**20
            self.bar.update(min(int(megabytes), self.bar.total),
                            {"MB/s": megabytes / max(now - self.bar.started, 1e-9)})

    def close(self) -> None:
        self.shown = 0.0
        self(name="", nbytes=0)
        self.bar.close()


class MetricsLog:
    """Appends one JSON object per logged step to `metrics.jsonl`, flushed so a crash keeps them."""

    def __init__(self, path: Path, resume: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a" if resume else "w")

    def write(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, png_path: Path) -> Path:
    """Training loss per step (and eval loss where measured), written where a person looks: the output dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
