"""Kill-and-resume soak: a run that is killed over and over, under random layouts, must end on the
uninterrupted curve. Not a CI test: it runs for many minutes and its kills land at random moments.

Each cycle resumes `latest` in one output_dir under a layout drawn at random (the global batch is
fixed, so every layout trains the same samples), with synchronous or `--async_save` saves every 2
steps, and SIGKILLs either the launcher's whole process group (as a scheduler or the OOM killer
does) or one rank, at a random moment, right after a save starts, or during start-up. Afterwards
it checks that the launcher ended, that no rank outlived it, and which half-written checkpoints
were left. A last run resumes to `--max_steps` on one process, and every step's loss in
metrics.jsonl is compared with one uninterrupted single-process run. Seeded: `--seed` replays a
sequence of layouts, kill targets and delays.

  .venv/bin/python bench/chaos_resume.py --cycles 20 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import machine, write_report

from paddle_pp.runtime.launch import processes_naming

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_pretrain.py"
MODEL = ["--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--max_seq_length", "32", "--global_batch_size", "8",
         "--per_device_train_batch_size", "1", "--warmup_steps", "5", "--eval_steps", "0", "--eval_iters", "1",
         "--logging_steps", "1", "--disable_progress_bar"]
LAYOUTS = {  # name: (processes, flags); all fit a 2-core machine
    "single": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["--tensor_parallel_degree", "2"]),
    "pp2": (2, ["--pipeline_parallel_degree", "2"]),
    "tp2_pp2": (4, ["--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2"]),
    "dp2_sharding2_stage1": (4, ["--sharding_parallel_degree", "2", "--sharding", "stage1"]),
    "pp2_vpp2": (2, ["--pipeline_parallel_degree", "2", "--virtual_pp_degree", "2"]),
}
HANG_S = 90.0  # a launcher still alive this long after a kill has hung (gloo's own timeout is 30 s)


def _launch(out: Path, cache: Path, logs: Path, nproc: int, flags: list[str], max_steps: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PADDLE_TRAINER_ID", None)
    command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir",
               str(logs), str(SCRIPT), *MODEL, *flags, "--max_steps", str(max_steps), "--data_cache", str(cache),
               "--output_dir", str(out)]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _unfinished_saves(out: Path) -> set[str]:
    return {p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".replaced-"))} if out.is_dir() else set()


def _phase(out: Path, logged_before: int, unfinished_before: set[str]) -> str:
    """What the job was doing when killed, read from the folder it writes."""
    if (out / ".latest.tmp").exists() or any(name.startswith(".replaced-") for name in _unfinished_saves(out)):
        return "mid-commit"
    if _unfinished_saves(out) - unfinished_before:
        return "mid-save"
    return "mid-step" if _logged_steps(out) > logged_before else "start-up"


def _logged_steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.is_file() else 0


def _wait_for_save_start(job: subprocess.Popen, out: Path, limit: float, unfinished_before: set[str]) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and job.poll() is None:
        if _unfinished_saves(out) - unfinished_before:
            return True
        time.sleep(0.005)
    return False


def _losses(path: Path) -> dict[int, float]:
    from paddle_pp.training.report import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r}


def run_cycle(rng: random.Random, layouts: list[str], out: Path, cache: Path, logs: Path, max_steps: int,
              typical_s: float, clean_steps: int = 0) -> dict:
    layout = rng.choice(layouts)
    nproc, flags = LAYOUTS[layout]
    flags = [*flags, "--save_steps", "2", "--resume_from_checkpoint", "latest"]
    asynchronous = rng.random() < 0.5
    if asynchronous:
        flags.append("--async_save")
    target, moment = rng.choice(["job", "job", "rank"]), rng.choice(["random", "random", "save-start", "start-up"])
    delay = {"random": rng.uniform(0, typical_s), "start-up": rng.uniform(0, 10), "save-start": rng.uniform(0, 0.5)}
    logged_before, unfinished_before = (_logged_steps(out) if out.is_dir() else 0), _unfinished_saves(out)
    if clean_steps:  # the control for kills: random layouts as in a soak, each job ending on its own
        flags += ["--exit_after_steps", str(clean_steps)]
        moment, delay["random"] = "random", None
    started = time.monotonic()
    job = _launch(out, cache, logs / f"cycle{len(list(logs.glob('cycle*')))}", nproc, flags, max_steps)
    if moment == "save-start" and not _wait_for_save_start(job, out, typical_s, unfinished_before):
        moment = "random"
    try:
        job.wait(timeout=delay[moment])
        return {"layout": layout, "async_save": asynchronous, "killed": False, "returncode": job.returncode,
                "seconds": time.monotonic() - started}
    except subprocess.TimeoutExpired:
        pass
    phase = _phase(out, logged_before, unfinished_before) if out.is_dir() else "start-up"
    ranks = processes_naming(str(out)) - {job.pid}
    if target == "rank" and ranks:
        os.kill(rng.choice(sorted(ranks)), signal.SIGKILL)
    else:
        target = "job"
        os.killpg(job.pid, signal.SIGKILL)
    try:
        job.wait(timeout=HANG_S)
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    deadline = time.monotonic() + 30
    while processes_naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = sorted(processes_naming(str(out)))
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    half_written = sorted(_unfinished_saves(out))
    return {"layout": layout, "async_save": asynchronous, "killed": True, "target": target, "moment": moment,
            "phase": phase, "hung": hung, "orphans": orphans, "half_written": half_written,
            "cleared_at_start": sorted(unfinished_before - _unfinished_saves(out)),
            "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=300, help="long enough that no cycle finishes the run")
    parser.add_argument("--kill_window", type=float, default=30.0, help="random kills land within this many seconds")
    parser.add_argument("--rtol", type=float, default=1e-4, help="a step's loss may differ this much (layouts)")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=sorted(LAYOUTS),
                        help="draw from these (only 'single': every resume must be bit-exact)")
    parser.add_argument("--control", choices=sorted(LAYOUTS), default=None,
                        help="also run once uninterrupted under this layout: the loss drift layouts alone cause")
    parser.add_argument("--clean_steps", type=int, default=0,
                        help="no kills: each cycle trains this many steps and exits cleanly (the control for kills)")
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/chaos_resume.json")
    args = parser.parse_args(argv)
    rng, began = random.Random(args.seed), time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        work = Path(work)
        cache, logs, out = work / "cache", work / "logs", work / "chaos"
        logs.mkdir()
        reference = _launch(work / "reference", cache, logs / "reference", 1, [], args.max_steps)
        reference_started = time.monotonic()
        if reference.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed; see {logs / 'reference'}")
        typical = min(time.monotonic() - reference_started, args.kill_window)
        cycles = []
        for number in range(args.cycles):
            cycles.append(run_cycle(rng, args.layouts, out, cache, logs, args.max_steps, typical, args.clean_steps))
            print(json.dumps({"cycle": number, **cycles[-1]}), flush=True)
        final = _launch(out, cache, logs / "final", 1, ["--save_steps", "2", "--resume_from_checkpoint", "latest"],
                        args.max_steps)
        final_code = final.wait()
        expected, got = _losses(work / "reference" / "metrics.jsonl"), _losses(out / "metrics.jsonl")
        control_difference = None
        if args.control:
            nproc, flags = LAYOUTS[args.control]
            if _launch(work / "control", cache, logs / "control", nproc, flags, args.max_steps).wait() == 0:
                control = _losses(work / "control" / "metrics.jsonl")
                control_difference = max(abs(control[s] - loss) / abs(loss) for s, loss in expected.items())
    differences = {step: abs(got[step] - loss) / abs(loss) for step, loss in expected.items() if step in got}
    killed = [c for c in cycles if c["killed"]]
    report = {
        **machine(), "seed": args.seed, "cycles": args.cycles, "max_steps": args.max_steps,
        "kills_by_phase": Counter(c["phase"] for c in killed), "kills_by_target": Counter(c["target"] for c in killed),
        "runs_that_ended_by_themselves": [c for c in cycles if not c["killed"]],
        "failed_runs": [c for c in cycles if not c["killed"] and c["returncode"] != 0],
        "half_written_checkpoints_left": sum(len(c["half_written"]) for c in killed),
        "half_written_cleared_by_the_next_job": sum(len(c.get("cleared_at_start", [])) for c in killed),
        "layouts": args.layouts,
        "hung_launchers": sum(c["hung"] for c in killed), "orphan_ranks": sum(len(c["orphans"]) for c in killed),
        "final_run_returncode": final_code, "steps_missing": sorted(set(expected) - set(got)),
        "steps_differing": sorted(s for s, d in differences.items() if d > args.rtol),
        "largest_relative_difference": max(differences.values(), default=None),
        "control_layout": args.control, "control_largest_relative_difference": control_difference,
        "wall_time_s": time.monotonic() - began, "cycle_log": cycles,
    }
    write_report(args.output, report)
    print(json.dumps({k: v for k, v in report.items() if k != "cycle_log"}, indent=1))
    clean = (final_code == 0 and not report["steps_missing"] and not report["steps_differing"]
             and not report["failed_runs"] and not report["hung_launchers"] and not report["orphan_ranks"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
