"""The mixed-precision check a machine with GPUs runs in one command (`bench/gpu_check.py`).

CPU cannot compute in bf16 or fp16 (Paddle 3.3.1 has no kernels and its autocast and loss scaler
switch themselves off there), so what the CPU tests prove is the bookkeeping. This runs the rest on
real GPUs: the tiny model in fp32 and bf16 under every layout the GPUs fit, each bf16 curve held to
the fp32 single-card curve within bf16's tolerance (and each fp32 layout within fp32's, TF32 off),
an evaluation at the last step (which crashed in bf16 before), a bf16 save under one layout
resumed under another in bf16 and in fp32, fp16 with its loss scaler saved in the checkpoint, and
`--amp_master_grad` with 8 micro-batches per step under tp2, pp2 and stage2 (fp32 main_grad
accumulation, whose bookkeeping the CPU tests prove bit for bit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paddle_pp.runtime.errors import UserError
from paddle_pp.training.alignment import run_deterministic
from paddle_pp.training.report import read_metrics

TINY = ("--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
        "--num_key_value_heads", "2", "--max_seq_length", "64", "--global_batch_size", "8",
        "--per_device_train_batch_size", "1", "--warmup_steps", "5", "--eval_iters", "1", "--disable_progress_bar",
        "--logging_steps", "1")
STEPS, RESUME_STEP = 20, 10
# Relative difference of a step's loss from the fp32 single-card run's: bf16 keeps 8 bits of
# mantissa (2^-8 relative rounding per op) and fp16 11; over 20 steps of this model the curves stay
# within a few 1e-3 in published bf16-vs-fp32 comparisons; 2e-2 leaves room and still fails a real
# bug (a loss computed in bf16, a dropped moment) by an order of magnitude. fp32 with TF32 off: 1e-4.
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "bf16_master_grad": 2e-2, "fp16": 2e-2}
PRECISION_FLAGS = {"fp32": (), "bf16": ("--bf16",), "fp16": ("--fp16",),
                   "bf16_master_grad": ("--bf16", "--amp_master_grad")}
LAYOUTS = {  # name -> (GPUs, flags)
    "single": (1, ()),
    "tp2": (2, ("--tensor_parallel_degree", "2")),
    "pp2": (2, ("--pipeline_parallel_degree", "2")),
    "stage1": (2, ("--sharding_parallel_degree", "2", "--sharding", "stage1")),
    "stage2": (2, ("--sharding_parallel_degree", "2", "--sharding", "stage2")),
    "stage3": (2, ("--sharding_parallel_degree", "2", "--sharding", "stage3", "--stage3_segment_size", "1024")),
    "tp2_sp": (2, ("--tensor_parallel_degree", "2", "--sequence_parallel")),
    "tp2pp2_sp": (4, ("--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2", "--sequence_parallel")),
    "tp2_stage2": (4, ("--tensor_parallel_degree", "2", "--sharding_parallel_degree", "2", "--sharding", "stage2")),
    "tp2_stage3": (4, ("--tensor_parallel_degree", "2", "--sharding_parallel_degree", "2", "--sharding", "stage3",
                       "--stage3_segment_size", "1024")),
}


class NoGpuError(UserError, RuntimeError):
    """The check needs CUDA devices this machine does not have."""


@dataclass
class Row:
    layout: str
    precision: str
    final_loss: float
    worst_rel: float
    tolerance: float
    note: str = ""
    sound: bool = True  # the row's own checks beside the losses (evaluation ran, schedule held, scaler saved)

    @property
    def passed(self) -> bool:
        return self.sound and self.worst_rel <= self.tolerance


def visible_gpus() -> int:
    """CUDA devices Paddle can use; raises with the fix when there are none."""
    import paddle

    if not paddle.device.is_compiled_with_cuda():
        raise NoGpuError(f"this Paddle ({paddle.__version__}) is a CPU build: the GPU check needs paddlepaddle-gpu 3.x "
                         "and a CUDA device. Install the GPU wheel for your CUDA version and run it again; on CPU "
                         "the test suite proves the mixed-precision bookkeeping (tests/test_mixed_precision.py).")
    count = paddle.device.cuda.device_count()
    if count == 0:
        raise NoGpuError("Paddle is built with CUDA but sees no GPU (check CUDA_VISIBLE_DEVICES and the driver)")
    return count


def _run(work: Path, name: str, gpus: int, flags: tuple[str, ...]) -> list[dict]:
    return read_metrics(run_deterministic(work, name, gpus, [*TINY, *flags], timeout=1800) / "metrics.jsonl")


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _worst_rel(ours: dict[int, float], reference: dict[int, float]) -> float:
    return max(abs(ours[s] - reference[s]) / abs(reference[s]) for s in ours)


def _trained_row(work: Path, layout: str, precision: str, reference: dict[int, float]) -> Row:
    gpus, flags = LAYOUTS[layout]
    records = _run(work, f"{layout}_{precision}", gpus, (*flags, *PRECISION_FLAGS[precision], "--max_steps",
                                                         str(STEPS), "--eval_steps", str(STEPS), "--save_steps",
                                                         str(RESUME_STEP)))
    losses = _losses(records)
    evaluated = any("eval_loss" in r for r in records)
    notes = [] if evaluated else ["NO evaluation recorded"]
    skipped = [r["step"] for r in records if r.get("update_skipped")]
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    held = all(lrs.get(step + 1, lrs[step]) == lrs[step] for step in skipped)
    if skipped:
        notes.append(f"{len(skipped)} update(s) skipped for overflow, schedule {'held' if held else 'ADVANCED'}")
    return Row(layout, precision, losses[STEPS], _worst_rel(losses, reference), TOLERANCE[precision],
               "; ".join(notes), evaluated and held)


def _resumed_row(work: Path, saved_as: str, layout: str, precision: str, reference: dict[int, float]) -> Row:
    """Resume the bf16 `saved_as` run's step-10 checkpoint under `layout` in `precision`."""
    gpus, flags = LAYOUTS[layout]
    checkpoint = work / f"{saved_as}_bf16" / f"checkpoint-{RESUME_STEP}"
    records = _run(work, f"{saved_as}_to_{layout}_{precision}", gpus, (
        *flags, *PRECISION_FLAGS[precision], "--max_steps", str(STEPS), "--resume_from_checkpoint", str(checkpoint)))
    losses = _losses(records)
    return Row(f"{saved_as} -> {layout}", f"bf16 -> {precision}", losses[STEPS],
               _worst_rel(losses, {s: reference[s] for s in losses}), TOLERANCE["bf16"], "resumed at step 10")


def _saved_loss_scale(work: Path, layout: str) -> float | None:
    state = json.loads((work / f"{layout}_fp16" / f"checkpoint-{RESUME_STEP}" / "trainer_state.json").read_text())
    return state.get("loss_scaler", {}).get("scale")


def run_gpu_check(work: Path, gpus: int | None = None) -> list[Row]:
    """Every row of the check on `gpus` devices (all that are visible by default)."""
    gpus = visible_gpus() if gpus is None else gpus
    work = Path(work)
    reference = _losses(_run(work, "single_fp32", 1, ("--max_steps", str(STEPS), "--eval_steps", str(STEPS),
                                                      "--save_steps", str(RESUME_STEP))))
    fitting = [name for name, (needed, _) in LAYOUTS.items() if needed <= gpus]
    rows = [Row("single", "fp32", reference[STEPS], 0.0, TOLERANCE["fp32"], "reference")]
    rows += [_trained_row(work, name, "fp32", reference) for name in fitting if name != "single"]
    rows += [_trained_row(work, name, "bf16", reference) for name in fitting]
    rows += [_trained_row(work, name, "bf16_master_grad", reference) for name in ("tp2", "pp2", "stage2")
             if name in fitting]
    fp16 = _trained_row(work, "single", "fp16", reference)
    scale = _saved_loss_scale(work, "single")
    fp16.note = "; ".join(filter(None, [fp16.note, f"loss scale {scale:g} saved" if scale else "NO loss scale saved"]))
    fp16.sound = fp16.sound and bool(scale)
    rows.append(fp16)
    saved_as = "tp2" if "tp2" in fitting else "single"
    for layout, precision in (("stage2" if "stage2" in fitting else "single", "bf16"), ("single", "fp32")):
        rows.append(_resumed_row(work, saved_as, layout, precision, reference))
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'layout':<22} {'precision':<14} {'final loss':>10} {'worst rel':>10} {'tolerance':>10}  verdict"]
    lines += [f"{r.layout:<22} {r.precision:<14} {r.final_loss:>10.4f} {r.worst_rel:>10.2e} {r.tolerance:>10.0e}  "
              f"{'ok' if r.passed else 'FAIL'}{'  (' + r.note + ')' if r.note else ''}" for r in rows]
    return "\n".join(lines)
