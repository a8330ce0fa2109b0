"""Precision alignment: from one checkpoint, train N steps on one card and under a layout, compare.

This is the check to run on a cluster before a long job: both runs resume the same checkpoint
with the same data order (the run's own arguments, recorded in trainer_state.json), save at the
end, and every loss, every parameter and the last step's gradients are compared. A layout that
drifts from single card beyond the tolerance fails here in minutes instead of after days.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint.format import GRADIENTS, MODEL, TRAINER_STATE_FILE, CheckpointError
from checkpoint.unified_io import UnifiedReader
from modeling.registry import load_config
from paddle_pp.runtime.launch import launch
from paddle_pp.runtime.layout import launched_device
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.model_config import end_of_document
from paddle_pp.training.report import read_metrics
from paddle_pp.training.run_plan import plan_run

RUN_SCRIPT = Path(__file__).resolve().parents[2] / "run_pretrain.py"
# Both runs compute in full fp32, deterministically: on GPU, TF32 matmuls (cuBLAS's via the driver's
# override and Paddle's flags, cuDNN's) would alone exceed the fp32 tolerance, and atomic-add
# kernels (embedding gradients, some cuDNN algorithms) differ run to run; PaddleNLP's align mode
# sets the two deterministic flags too. On CPU these change nothing.
ALIGNMENT_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "FLAGS_allow_tf32_cublas": "0", "FLAGS_allow_tf32_cudnn": "0",
                 "FLAGS_cudnn_deterministic": "1", "FLAGS_embedding_deterministic": "1"}
NOT_REPLAYED = {"config", "output_dir", "resume_from_checkpoint", "save_steps", "save_total_limit", "async_save",
                "save_gradients", "exit_after_steps", "disable_progress_bar", "tensor_parallel_degree",
                "pipeline_parallel_degree", "sharding_parallel_degree", "sharding", "virtual_pp_degree",
                "hybrid_parallel_topo_order"}


@dataclass
class AlignmentReport:
    steps: list[int]
    single_losses: list[float]
    layout_losses: list[float]
    tensor_diffs: dict[str, tuple[float, float]]  # name -> (max |a-b|, max |a-b| / max |a|)
    gradient_diffs: dict[str, tuple[float, float]]  # the last step's gradients, the same measures
    rtol: float

    @property
    def worst_loss_rel(self) -> float:
        return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(self.single_losses, self.layout_losses))

    @property
    def worst_tensor_rel(self) -> float:
        return max((rel for _, rel in self.tensor_diffs.values()), default=0.0)

    @property
    def worst_gradient_rel(self) -> float:
        return max((rel for _, rel in self.gradient_diffs.values()), default=0.0)

    @property
    def aligned(self) -> bool:
        return max(self.worst_loss_rel, self.worst_tensor_rel, self.worst_gradient_rel) <= self.rtol

    def table(self) -> str:
        lines = [f"{'step':>6} {'single':>12} {'layout':>12} {'rel diff':>10}"]
        for step, a, b in zip(self.steps, self.single_losses, self.layout_losses):
            lines.append(f"{step:>6} {a:>12.6f} {b:>12.6f} {abs(a - b) / max(abs(a), 1e-12):>10.2e}")
        for title, diffs in (("parameter", self.tensor_diffs), ("gradient, last step", self.gradient_diffs)):
            worst = sorted(diffs.items(), key=lambda kv: -kv[1][1])[:10]
            lines.append(f"{title + ' (10 worst)':<53} {'max abs':>10} {'max rel':>10}")
            lines += [f"{name:<53} {diff:>10.2e} {rel:>10.2e}" for name, (diff, rel) in worst]
        return "\n".join(lines)


def _replay_flags(checkpoint: Path) -> list[str]:
    """The saved run's own flags, minus layout and output ones, with its effective global batch
    pinned (a derived one would change with the data-parallel degree)."""
    state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
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


def _differences(single: Path, layout: Path, kind: str) -> dict[str, tuple[float, float]]:
    """Per tensor of `kind`: max |a - b| and that over max |a| (a the single-card value): relative to
    the tensor's own scale, which suits small gradients and near-zero weights alike."""
    ours, theirs = UnifiedReader(single, kind), UnifiedReader(layout, kind)
    if ours.tensors.keys() != theirs.tensors.keys():
        raise CheckpointError(f"{kind}: the two runs saved different tensors")
    diffs = {}
    for name in ours.tensors:
        value = ours.read(name).astype(np.float64)
        delta = np.abs(value - theirs.read(name))
        diffs[name] = (float(delta.max()), float(delta.max() / max(np.abs(value).max(), 1e-30)))
    return diffs


def run_deterministic(work_dir: Path, name: str, ranks: int, flags: list[str], timeout: float) -> Path:
    """run_pretrain.py with `flags` on `ranks` processes under `ALIGNMENT_ENV`, writing into
    `work_dir / name` (returned); the launcher's logs go beside it."""
    out = work_dir / name
    launch(RUN_SCRIPT, ranks, [*flags, "--output_dir", str(out)], work_dir=work_dir / f"{name}_job", timeout=timeout,
           env=ALIGNMENT_ENV, collect_results=False)
    return out


def _planned(checkpoint: Path, flags: list[str], ranks: int) -> None:
    """The trainer's plan of a run of `flags` on `ranks` processes resuming `checkpoint` (raises its refusal)."""
    args = parse_args(flags)
    folder = Path(args.model.model_name_or_path) if args.model.model_name_or_path else None
    plan_run(args, load_config(checkpoint), end_of_document(args, folder), ranks, launched_device())


def _losses(out: Path) -> tuple[list[int], list[float]]:
    records = read_metrics(out / "metrics.jsonl")
    return [r["step"] for r in records], [r["loss"] for r in records]


def check_alignment(checkpoint: Path, layout_flags: list[str], nproc: int, steps: int, work_dir: Path,
                    rtol: float = 1e-5, timeout: float = 1800.0) -> AlignmentReport:
    """Train `steps` steps from `checkpoint` on one card and on `nproc` ranks with `layout_flags`."""
    checkpoint, work_dir = Path(checkpoint), Path(work_dir)
    start = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())["step"]
    common = [*_replay_flags(checkpoint), "--resume_from_checkpoint", str(checkpoint), "--exit_after_steps",
              str(steps), "--save_steps", str(steps), "--logging_steps", "1", "--disable_progress_bar", "--save_gradients"]
    runs = (("single", 1, []), ("layout", nproc, layout_flags))
    for _, ranks, flags in runs:  # both refused here, before any launch, as their trainers would refuse them
        _planned(checkpoint, [*common, *flags], ranks)
    outputs = {name: run_deterministic(work_dir, name, ranks, [*common, *flags], timeout) for name, ranks, flags in runs}
    final = f"checkpoint-{start + steps}"
    single, layout = outputs["single"] / final, outputs["layout"] / final
    for saved in (single, layout):
        if not (saved / TRAINER_STATE_FILE).is_file():
            raise CheckpointError(f"{saved}: the run ended without saving step {start + steps}; see its logs in "
                                  f"{work_dir}")
    step_list, single_losses = _losses(outputs["single"])
    _, layout_losses = _losses(outputs["layout"])
    return AlignmentReport(step_list, single_losses, layout_losses, _differences(single, layout, MODEL),
                           _differences(single, layout, GRADIENTS), rtol)


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
