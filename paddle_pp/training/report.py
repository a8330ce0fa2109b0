"""What rank 0 shows and keeps: a progress bar (tqdm), `metrics.jsonl`, and `loss.png` at the end;
and the byte-progress bar of the offline checkpoint tools."""

from __future__ import annotations

import json
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
