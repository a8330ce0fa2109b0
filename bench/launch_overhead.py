"""Where a CPU launch's fixed time goes, outside the steps, measured side by side.

Each measurement runs in fresh processes, alternating the two ways `--repeats` times (medians):
- Paddle's launcher around a script that does nothing, `--nproc` ranks: from the launcher's start to
  the last rank starting, and from the last rank's end to the launcher's exit; the same through
  `runtime/launcher.py` (Paddle's launcher polling its ranks' exit every 50 ms, not every second);
- a one-process job end to end, through Paddle's launcher against `runtime/launch.py`'s direct start
  (`python script`, as a user runs one card);
- `import paddle` alone, in one process;
- paddle-pp's trainer imports (`paddle_pp.training.cli`) with PaddleNLP's inits skipped
  (`runtime/startup.py`) against the same imports with `paddlenlp.data`'s and
  `paddlenlp.transformers`' inits run (the top init skipped, as before this start-up);
- rank 0's plot at the end of a run: `loss.svg` written directly (`training/loss_plot.py`) against
  the matplotlib `loss.png` of the same records that it replaced.
Writes bench/results/launch_overhead.json.

  .venv/bin/python bench/launch_overhead.py --nproc 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine

from paddle_pp.runtime.launch import launch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "launch_overhead.json"
NOOP = ("import os, sys, time; "
        "open(os.path.join(sys.argv[1], os.environ.get('PADDLE_TRAINER_ID', '0')), 'w').write(str(time.time()))")
IMPORTS = {"paddlenlp inits skipped (paddle-pp)": "import paddle_pp.training.cli",
           # the start-up before: only paddlenlp's top init skipped, data's and transformers' run
           "paddlenlp data/transformers inits run": "from paddle_pp.runtime import startup; startup.lean_paddlenlp(); "
                                                     "startup._complete_up_to('paddlenlp.transformers'); "
                                                     "import paddle_pp.training.cli"}
RECORDS = [{"step": i, "loss": 8.3 - 0.04 * i, **({"eval_loss": 8.2 - 0.04 * i} if i % 10 == 0 else {})}
           for i in range(1, 201)]
PLOTS = {
    "loss.svg (paddle-pp)": "from paddle_pp.training.loss_plot import plot_loss; plot_loss(RECORDS, OUT + '/loss.svg')",
    "matplotlib loss.png": """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot([r["step"] for r in RECORDS], [r["loss"] for r in RECORDS], label="train loss")
ax.plot([r["step"] for r in RECORDS if "eval_loss" in r], [r["eval_loss"] for r in RECORDS if "eval_loss" in r], "o-",
        label="eval loss")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.grid(alpha=0.3); ax.legend(); fig.tight_layout()
fig.savefig(OUT + "/loss.png", dpi=100)
"""}


def _python(code: str, env: dict | None = None) -> float:
    """Seconds one fresh interpreter takes to run `code` (start-up included, as a rank pays it)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, **(env or {})},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


STOCK, OURS = "paddle.distributed.launch", "paddle_pp.runtime.launcher"


def _noop_job(folder: str, nproc: int, direct: bool = False, module: str = STOCK) -> None:
    """The no-op script on `nproc` ranks writing into `folder`: through a launcher `module`, or (one
    process) started by `runtime/launch.py` as the suite starts it."""
    script = Path(folder) / "noop.py"
    script.write_text(NOOP)
    if direct:
        launch(script, nproc, [folder], work_dir=Path(folder) / "job", collect_results=False)
        return
    subprocess.run([sys.executable, "-m", module, "--nproc_per_node", str(nproc), "--log_dir",
                    str(Path(folder) / "log"), str(script), folder], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=REPO)


def launcher(nproc: int, module: str = STOCK) -> tuple[float, float]:
    """(launcher start -> last rank started, last rank ended -> launcher exit) of a no-op job."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.time()
        _noop_job(folder, nproc, module=module)
        end = time.time()
        started = max(float((Path(folder) / str(rank)).read_text()) for rank in range(nproc))
    return started - start, end - started


def one_process_job(direct: bool) -> float:
    """Seconds a one-process no-op job takes end to end, started by `runtime/launch.py` (direct) or by
    Paddle's launcher."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        _noop_job(folder, 1, direct)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {"PYTHONPATH": str(REPO)}
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        prelude = f"RECORDS = {RECORDS!r}; OUT = {out!r}\n"
        for _ in range(args.repeats):
            for name, module in (("launcher", STOCK), ("paddle-pp launcher", OURS)):
                to_ranks, after_ranks = launcher(args.nproc, module)
                times.setdefault(f"{name}: start -> last rank started", []).append(to_ranks)
                times.setdefault(f"{name}: last rank ended -> exit", []).append(after_ranks)
            for name, direct in (("one-process job: Paddle's launcher", False), ("one-process job: direct", True)):
                times.setdefault(name, []).append(one_process_job(direct))
            times.setdefault("import paddle", []).append(_python("import paddle"))
            for name, code in {**IMPORTS, **{name: prelude + code for name, code in PLOTS.items()}}.items():
                times.setdefault(name, []).append(_python(code, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:45s} {value:6.2f} s")
    ratios = {"trainer imports": medians["paddlenlp data/transformers inits run"] / medians["paddlenlp inits skipped (paddle-pp)"],
              "plot": medians["matplotlib loss.png"] / medians["loss.svg (paddle-pp)"],
              "one-process job": medians["one-process job: Paddle's launcher"] / medians["one-process job: direct"],
              "launcher exit": medians["launcher: last rank ended -> exit"]
              / medians["paddle-pp launcher: last rank ended -> exit"]}
    print(f"trainer imports {ratios['trainer imports']:.2f}x faster, end-of-run plot {ratios['plot']:.2f}x faster, "
          f"one-process job {ratios['one-process job']:.2f}x faster, launcher exit {ratios['launcher exit']:.2f}x faster")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "nproc": args.nproc, "repeats": args.repeats,
                                   "median_s": medians, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
