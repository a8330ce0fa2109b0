"""Start real multi-process jobs through `paddle.distributed.launch` and collect one JSON result per rank.
A one-process job is started as a user runs one card, `python script`, without the launcher.

Tests and tools use this instead of mocks: every layout claim is proven by processes that talk
over gloo exactly as a cluster's do over NCCL. A hard timeout kills the whole process group, and
any failure reports the tail of every worker's log, so a hang or a crash is diagnosable from CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

RESULT_DIR_ENV = "PADDLE_PP_RESULT_DIR"
LOG_TAIL_CHARS = 4000


class LaunchError(RuntimeError):
    """A launched job failed, timed out, or a rank wrote no result. `rank_logs` holds every rank's
    whole log by global rank, so a caller can ask what one rank said without knowing where the
    launcher keeps its logs."""

    def __init__(self, message: str, silent_abort: bool = False, rank_logs: dict[int, str] | None = None):
        super().__init__(message)
        self.silent_abort = silent_abort
        self.rank_logs = rank_logs or {}


SIGNAL_EXIT = re.compile(r"Container rank \d+ status failed .* code -6 ")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` now (the launcher's master, a gloo group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def processes_naming(text: str) -> set[int]:
    """Live (not zombie) processes on this machine whose command line contains `text`: how a
    caller finds the ranks of a job it did not start itself (they run in sessions of their own)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if text in (proc / "cmdline").read_bytes().decode(errors="replace") and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.add(int(proc.name))
        except OSError:  # the process ended while we looked
            continue
    return found


def write_result(payload: dict[str, Any]) -> None:
    """Called inside a worker: store this rank's JSON result where `launch` collects it."""
    result_dir = os.environ.get(RESULT_DIR_ENV)
    if not result_dir:
        return
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    path = Path(result_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


ERROR_MARKERS = ("Error", "error:", "Traceback", "terminate called", "what():", "Check failed", "Aborted", "FATAL",
                 "Fatal Python error", "File \"")
FAILED_CONTAINER = re.compile(r"Container rank (\d+) status failed")


def _logs_report(log_dirs: Sequence[Path], launcher_output: str) -> str:
    """The launcher's tail, then every worker log: the ranks the launcher saw fail first, each
    preceded by its lines that look like errors, so a truncated CI report still names the cause."""
    failed = {int(rank) for rank in FAILED_CONTAINER.findall(launcher_output)}
    logs = [log for log_dir in log_dirs for log in sorted(log_dir.glob("workerlog.*"))]
    logs.sort(key=lambda log: int(log.suffix[1:]) not in failed)
    parts = [f"--- launcher output (tail) ---\n{launcher_output[-LOG_TAIL_CHARS:]}"]
    for log in logs:
        text = log.read_text(errors="replace")
        errors = [line for line in text.splitlines() if any(marker in line for marker in ERROR_MARKERS)]
        summary = "\n".join(errors[-20:]) or "(no error lines)"
        parts.append(f"--- {log}: error lines ---\n{summary}\n--- {log} (tail) ---\n{text[-LOG_TAIL_CHARS:]}")
    return "\n".join(parts)


def _rank_logs(log_dirs: Sequence[Path], nproc: int) -> dict[int, str]:
    """Every worker log by global rank (node n's local rank r is global rank n * nproc + r)."""
    logs = {}
    for node, log_dir in enumerate(log_dirs):
        for log in log_dir.glob("workerlog.*"):
            logs[node * nproc + int(log.suffix[1:])] = log.read_text(errors="replace")
    return logs


def launch(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    *,
    work_dir: str | os.PathLike,
    timeout: float = 300.0,
    nnodes: int = 1,
    env: dict[str, str] | None = None,
    retries_on_silent_abort: int = 0,
    collect_results: bool = True,
) -> list[dict[str, Any]]:
    """Run `script` on `nnodes` x `nproc` ranks on this machine and return each rank's result, by rank
    (one rank: started directly, its log still at `log_node0/workerlog.0`).

    With `nnodes > 1`, one launcher per node is started with `--master 127.0.0.1:PORT --nnodes`,
    exactly as a user starts a multi-node job, so the multi-node rendezvous path is exercised.

    `retries_on_silent_abort` relaunches a job in which a rank died of SIGABRT without printing any
    error: a rare crash inside Paddle's gloo runtime on oversubscribed CPUs (docs/known-problems.md, "Known
    problems"). Any other failure, and any wrong result, is never retried. Scripts that report
    through files of their own (run_pretrain.py) are launched with `collect_results=False`.
    """
    for attempt in range(retries_on_silent_abort + 1):
        try:
            return _launch_once(script, nproc, args, Path(work_dir) / f"attempt{attempt}", timeout, nnodes, env,
                                collect_results)
        except LaunchError as err:
            if not err.silent_abort or attempt == retries_on_silent_abort:
                raise
            warnings.warn(f"relaunching after a silent SIGABRT (attempt {attempt}): {str(err)[:2000]}", stacklevel=2)
    raise AssertionError("unreachable")


def _launch_once(script, nproc: int, args: Sequence[str], work_dir: Path, timeout: float, nnodes: int,
                 env: dict[str, str] | None, collect_results: bool) -> list[dict[str, Any]]:
    result_dir = work_dir / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    # One math thread per rank unless told otherwise: N ranks each spawning a thread per core
    # oversubscribe the CPU and stretch the waits between collectives.
    threads = str(max(1, (os.cpu_count() or 1) // (nproc * nnodes)))
    # PYTHONFAULTHANDLER: a rank killed by a signal (a C++ abort) still prints its Python stack.
    run_env = {"OMP_NUM_THREADS": threads, **os.environ, **(env or {}), RESULT_DIR_ENV: str(result_dir),
               "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    run_env.pop("PADDLE_TRAINER_ID", None)
    log_dirs = [work_dir / f"log_node{node}" for node in range(nnodes)]
    procs = _start_single(script, args, log_dirs[0], run_env) if nproc * nnodes == 1 else \
        _start_launchers(script, nproc, args, log_dirs, run_env)
    outputs, failures = _wait_all(procs, timeout)
    if failures:
        launcher_output = "".join(outputs)
        report = _logs_report(log_dirs, launcher_output)
        aborted = bool(SIGNAL_EXIT.search(launcher_output)) or procs[0].returncode == -signal.SIGABRT
        silent = aborted and "Traceback" not in report and "timed out" not in failures[0]
        raise LaunchError(f"{'; '.join(failures)}\n{report}", silent_abort=silent, rank_logs=_rank_logs(log_dirs, nproc))
    results = []
    for rank in range(nproc * nnodes if collect_results else 0):
        path = result_dir / f"rank{rank}.json"
        if not path.exists():
            raise LaunchError(f"rank {rank} wrote no result\n{_logs_report(log_dirs, ''.join(outputs))}")
        results.append(json.loads(path.read_text()))
    return results


def _start_launchers(script, nproc: int, args: Sequence[str], log_dirs: list[Path],
                     run_env: dict[str, str]) -> list[subprocess.Popen]:
    """One Paddle launcher per node (`runtime/launcher.py`: `paddle.distributed.launch` noticing its ranks'
    exit within 50 ms), each starting `nproc` ranks that log to its log dir."""
    master = f"127.0.0.1:{free_port()}"
    procs = []
    for node, log_dir in enumerate(log_dirs):
        cmd = [sys.executable, "-m", "paddle_pp.runtime.launcher", "--nproc_per_node", str(nproc),
               "--log_dir", str(log_dir)]
        if len(log_dirs) > 1:
            cmd += ["--master", master, "--nnodes", str(len(log_dirs)), "--rank", str(node)]
        cmd += [str(script), *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    return procs


def _start_single(script, args: Sequence[str], log_dir: Path, run_env: dict[str, str]) -> list[subprocess.Popen]:
    """A one-process job started as a user runs one card (`python script ...`), logging where the
    launcher would (`workerlog.0`): Paddle's launcher adds nothing to one process but 3.6 s of its
    own start and exit (docs/benchmarks.md, "A launch's fixed time")."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "workerlog.0", "w") as log:
        return [subprocess.Popen([sys.executable, str(script), *map(str, args)], env=run_env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[str], list[str]]:
    """Wait for every launcher under one deadline; on expiry kill all of them, not just the late one."""
    deadline = time.monotonic() + timeout
    outputs, failures = [], []
    for node, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for other in procs:
                _kill_group(other)
            out, _ = proc.communicate()
            failures.append(f"node {node} timed out after {timeout:.0f}s")
        outputs.append(out or "")
        if proc.returncode != 0 and not any(f.startswith(f"node {node} ") for f in failures):
            failures.append(f"node {node} exited with code {proc.returncode}")
    return outputs, failures


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
