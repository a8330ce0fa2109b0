"""What a CPU job's start-up spends on Paddle's TCP stores, with and without Nagle's algorithm, side by side.

`paddle_pp/runtime/backends/cpu.py::set_tcp_nodelay` turns Nagle's algorithm off on the TCPStore
clients Paddle 3.3.1 connects with it on. This launches `--nproc` ranks (the launcher the tests
and users run) and, inside the one job, alternates `--repeats` times between the two settings:
- one job-store operation (`add`), timed over `--ops` operations per rank;
- one gloo group of every rank created as the CPU backend creates them (a TCPStore of its own,
  published on the job store, then Paddle's `ProcessGroupGloo.create` rendezvousing through it),
  timed over `--groups` groups.
Prints the medians (of the slowest rank) and their ratio, and how many gloo groups a 4-rank
tp2 x pp2 trainer job creates (from fleet's log), and writes bench/results/job_startup.json.

  .venv/bin/python bench/job_startup.py --nproc 4 --ops 50 --groups 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results" / "job_startup.json"
SETTINGS = {"nagle on (Paddle's clients)": False, "TCP_NODELAY (paddle-pp)": True}


def _group(store, rank: int, world: int, group_id: int, nodelay: bool) -> None:
    """One gloo group of every rank, its store made as the CPU backend makes it, with Nagle's
    algorithm as asked on every socket before gloo's rendezvous runs through the store."""
    from paddle.base import core

    from paddle_pp.runtime.backends import cpu

    group_store = cpu.make_group_store(store, rank, world, f"bench/group/{group_id}")
    cpu.set_tcp_nodelay(nodelay)
    core.ProcessGroupGloo.create(group_store, rank, world, group_id)


def worker(ops: int, groups: int, repeats: int) -> None:
    from paddle.base import core

    from paddle_pp.runtime.backends import cpu
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.layout import Layout, launched_world_size
    from paddle_pp.runtime.topology import end_job, init_distributed

    topo = init_distributed(Layout(world_size=launched_world_size()))
    rank, world = topo.global_rank, topo.layout.world_size
    store = core.create_or_get_global_tcp_store()
    timings = {name: {"store_op_s": [], "group_s": []} for name in SETTINGS}
    group_id = 10_000
    for repeat in range(repeats):
        for name, nodelay in SETTINGS.items():
            cpu.set_tcp_nodelay(nodelay)
            cpu.store_barrier()
            start = time.perf_counter()
            for op in range(ops):
                store.add(f"bench/ops/{repeat}/{name}/{op}", 1)
            timings[name]["store_op_s"].append((time.perf_counter() - start) / ops)
            cpu.store_barrier()
            start = time.perf_counter()
            for _ in range(groups):
                group_id += 1
                _group(store, rank, world, group_id, nodelay)
            timings[name]["group_s"].append((time.perf_counter() - start) / groups)
    cpu.set_tcp_nodelay(True)
    write_result({"rank": rank, "timings": timings})
    end_job(topo)


def groups_in_trainer_job() -> int:
    """gloo groups (one TCPStore each, and the job store) a 4-rank tp2 x pp2 trainer job creates on CPU."""
    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="job_startup_"))
    flags = ["--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads",
             "4", "--num_key_value_heads", "2", "--max_seq_length", "32", "--max_steps", "1", "--warmup_steps", "0", "--do_eval", "false",
             "--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2", "--disable_progress_bar",
             "--output_dir", str(work / "out")]
    launch(REPO / "run_pretrain.py", 4, flags, work_dir=work / "job", timeout=600, collect_results=False)
    log = (work / "job" / "attempt0" / "log_node0" / "workerlog.0").read_text()
    return log.count("create libuv server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.ops, args.groups, args.repeats)
        return
    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="job_startup_"))
    ranks = launch(Path(__file__), args.nproc, ["--worker", "--ops", args.ops, "--groups", args.groups, "--repeats",
                                                args.repeats], work_dir=work, timeout=900)
    result = {"machine": machine(), "nproc": args.nproc, "ops": args.ops, "groups": args.groups,
              "repeats": args.repeats, "medians": {}}
    for name in SETTINGS:
        result["medians"][name] = {
            measure: statistics.median(max(rank["timings"][name][measure][r] for rank in ranks)
                                       for r in range(args.repeats))
            for measure in ("store_op_s", "group_s")}
    off, on = (result["medians"][name] for name in SETTINGS)
    result["ratios"] = {measure: off[measure] / on[measure] for measure in off}
    result["trainer_job_stores"] = groups_in_trainer_job()
    for name, medians in result["medians"].items():
        print(f"{name:32s} store op {medians['store_op_s'] * 1e3:8.2f} ms   gloo group {medians['group_s']:6.3f} s")
    print(f"ratios (Nagle / no delay): store op {result['ratios']['store_op_s']:.0f}x, "
          f"gloo group {result['ratios']['group_s']:.1f}x; a 4-rank tp2 x pp2 trainer job creates "
          f"{result['trainer_job_stores']} TCP stores; {machine()}")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
