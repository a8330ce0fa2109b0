"""Precision alignment: from one checkpoint, train N steps on one card and under a layout, compare.

This is the check to run on a cluster before a long job: both runs resume the same checkpoint
with the same data order (the run's own arguments, recorded in trainer_state.json), save at the
end, and every loss and every parameter is compared. A layout that drifts from single card
beyond the tolerance fails here in minutes instead of after days.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint.format import MODEL, read_index
from checkpoint.shards import ShardReader
from paddle_pp.launch import launch

RUN_SCRIPT = Path(__file__).resolve().parents[1] / "run_pretrain.py"
NOT_REPLAYED = {"config", "output_dir", "resume_from_checkpoint", "save_steps", "save_total_limit", "async_save",
                "exit_after_steps", "disable_progress_bar", "tensor_parallel_degree", "pipeline_parallel_degree",
                "sharding_parallel_degree", "sharding", "virtual_pp_degree", "hybrid_parallel_topo_order"}


@dataclass
class AlignmentReport:
    steps: list[int]
    single_losses: list[float]
    layout_losses: list[float]
    tensor_diffs: dict[str, tuple[float, float]]  # name -> (max |a-b|, max |a-b| / (1 + |a|))
    rtol: float

    @property
    def worst_loss_rel(self) -> float:
        return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(self.single_losses, self.layout_losses))

    @property
    def worst_tensor_rel(self) -> float:
        return max((rel for _, rel in self.tensor_diffs.values()), default=0.0)

    @property
    def aligned(self) -> bool:
        return self.worst_loss_rel <= self.rtol and self.worst_tensor_rel <= self.rtol

    def table(self) -> str:
        lines = [f"{'step':>6} {'single':>12} {'layout':>12} {'rel diff':>10}"]
        for step, a, b in zip(self.steps, self.single_losses, self.layout_losses):
            lines.append(f"{step:>6} {a:>12.6f} {b:>12.6f} {abs(a - b) / max(abs(a), 1e-12):>10.2e}")
        worst = sorted(self.tensor_diffs.items(), key=lambda kv: -kv[1][1])[:10]
        lines.append(f"{'parameter (10 worst)':<48} {'max abs':>10} {'max scaled':>10}")
        lines += [f"{name:<48} {diff:>10.2e} {rel:>10.2e}" for name, (diff, rel) in worst]
        return "\n".join(lines)


def _replay_flags(checkpoint: Path) -> list[str]:
    """The saved run's own flags, minus layout and output ones, with its effective global batch
    pinned (a derived one would change with the data-parallel degree)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    args = {**state["args"], "global_batch_size": state["global_batch_size"]}
    flags = []
    for key, value in sorted(args.items()):
        if key in NOT_REPLAYED or value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        else:
            flags += [f"--{key}", str(value)]
    return flags


def _parameters(folder: Path) -> dict[str, np.ndarray]:
    index = read_index(folder, MODEL)
    readers = {f: ShardReader(folder / f) for f in sorted(set(index["weight_map"].values()))}
    return {name: readers[f].read(name) for name, f in index["weight_map"].items()}


def _losses(out: Path) -> tuple[list[int], list[float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [r["loss"] for r in records]


def check_alignment(checkpoint: Path, layout_flags: list[str], nproc: int, steps: int, work_dir: Path,
                    rtol: float = 1e-5, timeout: float = 1800.0) -> AlignmentReport:
    """Train `steps` steps from `checkpoint` on one card and on `nproc` ranks with `layout_flags`."""
    checkpoint, work_dir = Path(checkpoint), Path(work_dir)
    start = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    common = [*_replay_flags(checkpoint), "--resume_from_checkpoint", str(checkpoint), "--exit_after_steps",
              str(steps), "--save_steps", str(steps), "--logging_steps", "1", "--disable_progress_bar"]
    outputs = {}
    for name, ranks, flags in (("single", 1, []), ("layout", nproc, layout_flags)):
        outputs[name] = work_dir / name
        launch(RUN_SCRIPT, ranks, [*common, *flags, "--output_dir", str(outputs[name])], work_dir=work_dir / f"{name}_job",
               timeout=timeout)
    final = f"checkpoint-{start + steps}"
    single, layout = _parameters(outputs["single"] / final), _parameters(outputs["layout"] / final)
    diffs = {}
    for name, value in single.items():
        delta = np.abs(value.astype(np.float64) - layout[name])
        diffs[name] = (float(delta.max()), float((delta / (1.0 + np.abs(value))).max()))
    step_list, single_losses = _losses(outputs["single"])
    _, layout_losses = _losses(outputs["layout"])
    return AlignmentReport(step_list, single_losses, layout_losses, diffs, rtol)


def plot_alignment(report: AlignmentReport, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(report.steps, report.single_losses, label="single card")
    top.plot(report.steps, report.layout_losses, "--", label="layout")
    top.set_ylabel("loss")
    top.legend()
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(report.single_losses, report.layout_losses)]
    bottom.semilogy(report.steps, np.maximum(rel, 1e-12), "o-")
    bottom.axhline(report.rtol, color="red", linestyle=":", label=f"tolerance {report.rtol:g}")
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative loss difference")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
