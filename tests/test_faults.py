"""Faults as a scheduler deals them: the launcher killed with its ranks still training, a second
job started into the same output_dir, a metrics line torn by a kill, an older writer committing
after a newer one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint.commit import clear_interrupted_saves, commit, latest_checkpoint, temp_dir
from paddle_pp.runtime.launch import processes_naming
from paddle_pp.training.output_lock import LOCK_FILE, OutputDirInUseError, acquire, release
from paddle_pp.training.report import MetricsLog, read_metrics

from runs import MODEL, REPO, SCRIPT


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds:.0f}s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.multiproc
def test_killing_the_launcher_leaves_no_rank_behind(tmp_path, data_cache):
    """SIGKILL to the launcher's process group (what a scheduler sends) must end every rank,
    though paddle.distributed.launch starts each rank in a session of its own."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PADDLE_TRAINER_ID", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
         str(SCRIPT), *MODEL, "--max_steps", "100000", "--data_cache", str(data_cache), "--output_dir", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: launcher.poll() is None and metrics.is_file() and metrics.read_text().strip()
                  or launcher.poll() is not None, 300, "the first logged step")
        assert launcher.poll() is None, "the job ended before it could be killed"
        ranks = processes_naming(str(out)) - {launcher.pid}
        assert len(ranks) == 2, ranks
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_for(lambda: not (processes_naming(str(out)) & ranks), 30, f"ranks {sorted(ranks)} to end")
    finally:
        for pid in processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_latest_only_moves_forward(tmp_path):
    for step in (2, 6):
        temp_dir(tmp_path, step).mkdir()
        commit(tmp_path, step)
    temp_dir(tmp_path, 4).mkdir()
    commit(tmp_path, 4)  # a stray writer of an older run commits after the newer one
    assert (tmp_path / "checkpoint-4").is_dir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-6"
    temp_dir(tmp_path, 6).mkdir()
    commit(tmp_path, 6)  # re-saving the newest step keeps it latest
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-6"


def test_a_resave_keeps_the_old_copy_until_the_new_is_in_and_a_restart_clears_what_kills_left(tmp_path):
    for content in ("old", "new"):
        temp_dir(tmp_path, 4).mkdir()
        (temp_dir(tmp_path, 4) / "weights").write_text(content)
        commit(tmp_path, 4)
    assert (tmp_path / "checkpoint-4" / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "latest"]
    # A re-save killed between its two renames (old copy moved aside, new one not in), and a save
    # killed while writing: the next job that holds the lock restores the one and deletes the other.
    os.replace(tmp_path / "checkpoint-4", tmp_path / ".replaced-checkpoint-4")
    temp_dir(tmp_path, 6).mkdir()
    (temp_dir(tmp_path, 6) / "weights").write_text("half")
    assert clear_interrupted_saves(tmp_path) == [".tmp-checkpoint-6", ".replaced-checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "latest"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert (tmp_path / "checkpoint-4" / "weights").read_text() == "new"


def test_resumed_metrics_hold_every_step_once_without_the_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    with pytest.warns(UserWarning, match="skipped 1 torn line"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    log = MetricsLog(path, resume_step=3)  # resumed from checkpoint-3: steps 4-6 are trained again
    assert (log.torn_lines, log.superseded) == (1, 2)
    for step in (4, 5):
        log.write({"step": step, "loss": 1.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 8.0), (2, 7.0), (3, 6.0), (4, 1.0), (5, 1.0)]
    fresh = MetricsLog(path)
    fresh.close()
    assert path.read_text() == ""


def test_a_second_job_into_the_same_output_dir_is_refused_naming_the_owner(tmp_path, data_cache):
    out = tmp_path / "out"
    flags = [*MODEL, "--data_cache", str(data_cache), "--output_dir", str(out)]
    first = subprocess.Popen([sys.executable, str(SCRIPT), *flags, "--max_steps", "100000"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: first.poll() is not None or (metrics.is_file() and metrics.read_text().strip()), 300,
                  "the first job's first step")
        assert first.poll() is None, "the first job ended early"
        second = subprocess.run([sys.executable, str(SCRIPT), *flags, "--max_steps", "6"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another job (host {socket.gethostname()}, pid {first.pid})" in second.stderr
    finally:
        first.kill()
        first.wait()
    temp_dir(out, 3).mkdir()  # what a job killed mid-save leaves; the next owner of the folder deletes it
    after = subprocess.run([sys.executable, str(SCRIPT), *flags, "--max_steps", "6"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert after.returncode == 0, after.stderr[-2000:]
    assert "cleared 1 save(s) a stopped job left unfinished: .tmp-checkpoint-3" in after.stderr
    assert not temp_dir(out, 3).exists()
    assert not (out / LOCK_FILE).exists(), "a finished run releases the lock it took over"


def _write_lock(folder: Path, host: str, pid: int, started: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"host": host, "pid": pid, "started": started}))
    return folder / LOCK_FILE


def test_lock_owners_dead_alive_elsewhere_or_torn(tmp_path, monkeypatch):
    finished = subprocess.Popen(["true"])
    finished.wait()
    _write_lock(tmp_path / "dead", socket.gethostname(), finished.pid, 12345)
    assert json.loads(acquire(tmp_path / "dead").read_text())["pid"] == os.getpid(), "a dead owner's lock is taken over"
    assert acquire(tmp_path / "dead") == tmp_path / "dead" / LOCK_FILE, "the owner may take its own lock again"
    reused = _write_lock(tmp_path / "reused", socket.gethostname(), os.getppid(), 1)  # a live pid, another start
    assert json.loads(acquire(reused.parent).read_text())["pid"] == os.getpid()
    _write_lock(tmp_path / "remote", "another-host", 4242, 7)
    with pytest.raises(OutputDirInUseError, match="host another-host, pid 4242"):
        acquire(tmp_path / "remote")
    monkeypatch.setattr("paddle_pp.training.output_lock.WRITE_GRACE_S", 0.05)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / LOCK_FILE).write_text('{"host": "x", "pi')
    lock = acquire(tmp_path / "torn")
    release(lock)
    assert not lock.exists()
