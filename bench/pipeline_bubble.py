"""Idle time per pipeline stage under each schedule fleet runs (1F1B, VPP, FThenB, DualPipeV), from
the order each schedule's own class computes in, beside the measured step time.

For each schedule at pp4 (8 LLaMA layers: hidden 256, sequence 128) and each micro-batch count, a
real launch (our trainer, one process per stage) records on every stage the sequence of forward,
backward and weight-gradient computations Paddle's class runs in one step (after two of warm-up),
with their times. The replay then schedules exactly those per-stage orders with unit costs (a whole
stage's forward 1, backward 2, or 1 + 1 where DualPipeV defers the weight gradient), each waiting
for its micro-batch on the neighbouring chunk and nothing else (free communication): idle per stage
= 1 - busy / makespan, the schedule's own bubble, machine-independent. The theory beside it:
(p - 1) / (m + p - 1) for 1F1B, (p - 1) / v / (m + (p - 1) / v) for VPP and FThenB (their fill and
drain pass chunks of 1/v of a stage). The replay also
counts each stage's peak of micro-batches alive (chunk forwards whose backward has not run, each its
share of the stage), against the planner's `planning.schedules.in_flight`. Measured: idle = 1 -
compute / `forward_backward_pipeline` time on this machine (4 processes on 2 shared cores oversubscribe it: communication and contention
count as idle). Writes bench/results/pipeline_bubble.json.

  .venv/bin/python bench/pipeline_bubble.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from machine import machine, write_report  # noqa: E402

MEASURED_STEPS, WARMUP_STEPS = 1, 2
SCHEDULES = {  # name: (flags, micro-batch counts): fleet runs FThenB at exactly pp micro-batches
    "1F1B": ((), (8, 16)),
    "VPP": (("--virtual_pp_degree", "2"), (8, 16)),
    "FThenB": (("--virtual_pp_degree", "2"), (4,)),
    "DualPipeV": (("--pipeline_schedule", "DualPipeV"), (8, 16)),
}


def _recorded(owner, method: str, log: list, kind: str, chunk_of) -> None:
    """Wrap `owner.method` to append (kind, chunk, extra, start, end) for every call."""
    original = getattr(owner, method)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        chunk, extra = chunk_of(args, kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            log.append((kind, chunk, extra, started, time.perf_counter()))

    setattr(owner, method, wrapper)


def _instrument(model, log: list) -> None:
    from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import WeightGradStore

    if hasattr(model, "_forward_compute"):  # DualPipeVParallel: phase 0 and 1 are the V's two arms
        _recorded(model, "_forward_compute", log, "F", lambda a, k: (a[0], None))
        _recorded(model, "_backward_compute", log, "B",
                  lambda a, k: (a[0], bool(a[1] if len(a) > 1 else k.get("enable_zb", False))))
        queued = WeightGradStore.funcs_queue
        _recorded(WeightGradStore, "pop", log, "W", lambda a, k: (None, len(queued.queue[0]) if queued.queue else 0))
        return
    _recorded(model, "_forward_step", log, "F", lambda a, k: (k.get("chunk_id", a[2] if len(a) > 2 else None), None))
    _recorded(model, "_backward_step", log, "B", lambda a, k: (k.get("chunk_id", a[3] if len(a) > 3 else None), None))


def worker(flags: list[str]) -> int:
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.topology import end_job
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    trainer = Pretrainer(parse_args(flags))
    log, pipeline = [], []
    _instrument(trainer.model, log)
    _recorded(trainer.model, "forward_backward_pipeline", pipeline, "step", lambda a, k: (None, None))
    for _ in range(WARMUP_STEPS):
        trainer.train_one_step()
    log.clear()
    pipeline.clear()
    for _ in range(MEASURED_STEPS):
        trainer.train_one_step()
    step = sum(end - start for *_, start, end in pipeline)
    busy = sum(end - start for kind, *_, start, end in log)
    write_result({"stage": trainer.topo.pp_rank, "ops": [(kind, chunk, extra) for kind, chunk, extra, *_ in log],
                  "busy_s": busy, "step_s": step, "idle": 1 - busy / step, "schedule": trainer.run_plan.schedule})
    return end_job(trainer.topo)


def global_chunk(schedule: str, stage: int, chunk, pp: int) -> int:
    """The position of a stage's chunk along the model (what its micro-batch waits for)."""
    if schedule == "DualPipeV":
        return stage if chunk == 0 else 2 * pp - 1 - stage
    return (chunk or 0) * pp + stage


def replay(schedule: str, orders: list[list], pp: int, chunks_per_stage: int, split_allowed: bool = True) -> dict:
    """Run each stage's recorded order with unit costs and free communication; per stage its idle
    fraction and its peak of whole-stage micro-batches alive (chunk forwards without their backward,
    each its share of the stage). `split_allowed` False: as if every backward computed its weight
    gradients at once (the same order without DualPipeV's zero-bubble split)."""
    split = split_allowed and any(kind == "W" and extra for kind, _, extra in (op for order in orders for op in order))
    share = 1 / chunks_per_stage
    tasks = []  # per stage: (kind, global chunk, micro-batch, cost)
    for stage, order in enumerate(orders):
        counts: dict = {}
        deferred: list = []
        listed = []
        for kind, chunk, extra in order:
            if kind == "W":
                listed.append(("W", None, deferred.pop(0) if deferred and split else None, share if split else 0.0))
                continue
            g = global_chunk(schedule, stage, chunk, pp)
            micro = counts.setdefault((kind, g), 0)
            counts[(kind, g)] += 1
            cost = share if kind == "F" else (share if split and extra else 2 * share)
            if kind == "B" and split and extra:
                deferred.append((g, micro))
            listed.append((kind, g, micro, cost))
        tasks.append(listed)
    last = pp * chunks_per_stage - 1
    done: dict = {}
    clock, position, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    alive, peak = [0] * pp, [0] * pp  # chunk forwards whose backward has not run
    progressed = True
    while progressed:
        progressed = False
        for stage in range(pp):
            while position[stage] < len(tasks[stage]):
                kind, g, micro, cost = tasks[stage][position[stage]]
                needs = [] if kind == "W" else [("F", g - 1, micro)] if kind == "F" and g > 0 else \
                    [("B", g + 1, micro)] if kind == "B" and g < last else []
                if any(need not in done for need in needs):
                    break
                start = max([clock[stage]] + [done[need] for need in needs])
                clock[stage] = start + cost
                busy[stage] += cost
                if kind != "W":
                    done[(kind, g, micro)] = clock[stage]
                    alive[stage] += 1 if kind == "F" else -1
                    peak[stage] = max(peak[stage], alive[stage])
                position[stage] += 1
                progressed = True
    if any(position[stage] < len(tasks[stage]) for stage in range(pp)):
        raise RuntimeError(f"{schedule}: the recorded orders wait on each other")
    makespan = max(clock)
    return {"idle": [1 - b / makespan for b in busy], "peak_alive": [p * share for p in peak], "weight_split": split}


def theory(schedule: str, pp: int, vpp: int, micro: int) -> float | None:
    bubble = {"1F1B": pp - 1, "FThenB": (pp - 1) / vpp, "VPP": (pp - 1) / vpp}.get(schedule)
    return None if bubble is None else bubble / (micro + bubble)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/pipeline_bubble.json")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)

    from paddle_pp.planning.schedules import in_flight
    from paddle_pp.runtime.launch import launch

    work, pp, rows = Path(tempfile.mkdtemp(prefix="pipeline_bubble_")), args.pp, []
    for name in args.schedules:
        flags, counts = SCHEDULES[name]
        vpp = 2 if "--virtual_pp_degree" in flags else 1
        chunks_per_stage = 2 if name == "DualPipeV" else vpp
        for micro in counts:
            tag = f"{name}_m{micro}"
            run = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.hidden_size * 11 // 4),
                   "--num_hidden_layers", str(args.num_hidden_layers), "--num_attention_heads",
                   str(args.hidden_size // 64), "--max_seq_length", str(args.max_seq_length),
                   "--pipeline_parallel_degree", str(pp), *flags, "--per_device_train_batch_size", "1",
                   "--global_batch_size", str(micro), "--max_steps", "1000", "--warmup_steps", "1", "--do_eval",
                   "false", "--data_cache", str(work / "data"), "--output_dir", str(work / tag),
                   "--disable_progress_bar"]
            results = sorted(launch(Path(__file__), pp, ["--worker", *run], work_dir=work / f"job_{tag}", timeout=900),
                             key=lambda r: r["stage"])
            assert {r["schedule"] for r in results} == {name}, [r["schedule"] for r in results]
            orders = [r["ops"] for r in results]
            replayed = replay(name, orders, pp, chunks_per_stage)
            unsplit = replay(name, orders, pp, chunks_per_stage, split_allowed=False)["idle"]
            planned = [in_flight(name, pp, vpp, stage, micro) for stage in range(pp)]
            row = {"schedule": name, "pp": pp, "micro_batches": micro, "theory": theory(name, pp, vpp, micro),
                   "replayed_idle": replayed["idle"], "weight_split": replayed["weight_split"],
                   "replayed_idle_without_split": unsplit, "orders": orders,
                   "peak_alive": replayed["peak_alive"], "planner_in_flight": planned,
                   "measured_idle": [r["idle"] for r in results], "step_s": max(r["step_s"] for r in results)}
            rows.append(row)
            shown = "-" if row["theory"] is None else f"{row['theory']:.3f}"
            print(f"{name:>9} pp{pp} m{micro:>2}: theory {shown}  replayed idle "
                  f"{[round(x, 3) for x in replayed['idle']]} (without a weight split "
                  f"{max(unsplit):.3f})  measured idle "
                  f"{[round(x, 3) for x in row['measured_idle']]}  step {row['step_s']:.2f} s  peak alive "
                  f"{replayed['peak_alive']}  planner {planned}", flush=True)
    report = {"machine": machine(), "model": vars(args) | {"output": None, "worker": None},
              "measured": time.strftime("%Y-%m-%d"), "rows": rows}
    write_report(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
