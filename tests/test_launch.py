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
