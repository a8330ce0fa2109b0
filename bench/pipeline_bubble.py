"""Per-stage busy and idle time of fleet's 1F1B schedule against the theory (p - 1) / (m + p - 1).

For pp in {2, 4} and m in {4, 8, 16} micro-batches, launches a LLaMA pipeline run (real processes,
our trainer) and times, on every stage, each micro-batch's forward and backward compute inside the
schedule. A step's pipeline time is its `forward_backward_pipeline` call; busy is the compute
inside it; idle = 1 - busy / pipeline time (waiting on neighbours, p2p, and the fill and drain
bubble). Theory assumes equal stages and free communication, so the bottleneck stage (least idle)
is the one to compare. Writes bench/results/pipeline_bubble.json.

  .venv/bin/python bench/pipeline_bubble.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEASURED_STEPS, WARMUP_STEPS = 3, 2


def _timed(owner, method: str, log: list[float]) -> None:
    original = getattr(owner, method)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - started)

    setattr(owner, method, wrapper)


def worker(flags: list[str]) -> int:
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.topology import end_job
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    trainer = Pretrainer(parse_args(flags))
    compute, pipeline = [], []
    _timed(trainer.model, "_forward_step", compute)
    _timed(trainer.model, "_backward_step", compute)
    _timed(trainer.model, "forward_backward_pipeline", pipeline)
    for _ in range(WARMUP_STEPS):
        trainer.train_one_step()
    compute.clear()
    pipeline.clear()
    for _ in range(MEASURED_STEPS):
        trainer.train_one_step()
    busy, total = sum(compute), sum(pipeline)
    write_result({"stage": trainer.topo.pp_rank, "busy_s": busy, "pipeline_s": total, "idle": 1 - busy / total})
    return end_job(trainer.topo)


def uneven_stage_theory(busy_s: list[float], micro_batches: int) -> float:
    """The bottleneck stage's idle fraction under 1F1B with free communication when stages differ:
    the step lasts m micro-batches of the slowest stage plus one of every other (fill and drain),
    so idle = 1 - m t_b / (m t_b + sum of the others' t). Equal stages give (p-1)/(m+p-1)."""
    per_micro = [busy / micro_batches for busy in busy_s]
    slowest = max(per_micro)
    return 1 - micro_batches * slowest / (micro_batches * slowest + sum(per_micro) - slowest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro_batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/pipeline_bubble.json")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)

    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="pipeline_bubble_"))
    rows = []
    for pp in args.pp:
        for micro in args.micro_batches:
            flags = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.hidden_size * 11 // 4),
                     "--num_hidden_layers", str(args.num_hidden_layers), "--num_attention_heads",
                     str(args.hidden_size // 64), "--max_seq_length", str(args.max_seq_length),
                     "--pipeline_parallel_degree", str(pp), "--per_device_train_batch_size", "1",
                     "--global_batch_size", str(micro), "--max_steps", "1000", "--warmup_steps", "1",
                     "--data_cache", str(work / "data"), "--output_dir", str(work / f"pp{pp}_m{micro}"),
                     "--disable_progress_bar"]
            results = launch(Path(__file__), pp, ["--worker", *flags], work_dir=work / f"job_pp{pp}_m{micro}",
                             timeout=600)
            stages = sorted(results, key=lambda r: r["stage"])
            theory = (pp - 1) / (micro + pp - 1)
            uneven = uneven_stage_theory([r["busy_s"] for r in stages], micro)
            measured = min(r["idle"] for r in stages)
            rows.append({"pp": pp, "micro_batches": micro, "theory": theory, "bottleneck_idle": measured,
                         "relative_error": (measured - theory) / theory, "theory_measured_stages": uneven,
                         "stages": stages})
            print(f"pp {pp} m {micro:>2}: theory {theory:.3f}  with measured stage times {uneven:.3f}  bottleneck "
                  f"stage idle {measured:.3f} ({(measured - theory) / theory:+.0%})  per stage "
                  f"{[round(r['idle'], 3) for r in stages]}", flush=True)
    report = {"device": f"CPU, {os.cpu_count()} cores, one process per stage", "model": vars(args) | {"output": None},
              "measured": time.strftime("%Y-%m-%d"), "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
