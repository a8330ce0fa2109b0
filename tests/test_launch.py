"""The launcher retries only a silent SIGABRT, never a Python error."""

from __future__ import annotations

import pytest

from paddle_pp.runtime.launch import LaunchError

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("nproc", [1, 2])  # one process runs without Paddle's launcher
def test_silent_abort_is_relaunched_once(run_workers, tmp_path, nproc):
    results = run_workers("abort_once_worker.py", nproc, [tmp_path / "marker"], timeout=120, tag="abort")
    assert [r["rank"] for r in results] == list(range(nproc))
    assert (tmp_path / "marker").exists(), "the first attempt must have aborted"


@pytest.mark.parametrize("nproc", [1, 2])
def test_python_error_is_not_retried(run_workers, tmp_path, nproc):
    with pytest.raises(LaunchError, match="a real bug") as error:
        run_workers("abort_once_worker.py", nproc, [tmp_path / "marker", "--raise"], timeout=120, tag="raise")
    assert not error.value.silent_abort


class _Container:
    """A container whose status turns from running to `final` after it has been read `reads` times."""

    def __init__(self, final: str, reads: int = 0):
        self.final, self.reads = final, reads

    @property
    def status(self) -> str:
        self.reads -= 1
        return self.final if self.reads < 0 else "running"


class _Pod:
    def __init__(self, *containers):
        self._init_containers, self._containers = [], list(containers)


def test_a_failed_ranks_siblings_end_on_their_own_within_the_grace(monkeypatch):
    """The launcher's watch reports a failure only once the other ranks have ended by themselves (so a
    refusal each rank makes is in each rank's log), or once the grace is over for a rank that hangs."""
    from paddle_pp.runtime import launcher

    sibling = _Container("failed", reads=5)
    assert launcher.watch_often(_Pod(_Container("failed"), sibling)) == "failed"
    assert sibling.reads < 0, "the watch returned while the sibling still ran"
    hanging = _Container("failed", reads=10**9)
    monkeypatch.setattr(launcher, "SIBLING_GRACE_S", 0.2)
    assert launcher.watch_often(_Pod(_Container("failed"), hanging)) == "failed"
    assert launcher.watch_often(_Pod(_Container("completed"), _Container("completed", reads=3))) == "completed"
    assert launcher.watch_often(_Pod(_Container("running", reads=10**9)), timeout=0.1) is None
