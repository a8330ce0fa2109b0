"""The launcher retries only a silent SIGABRT, never a Python error."""

from __future__ import annotations

import pytest

from paddle_pp.runtime.launch import LaunchError

pytestmark = pytest.mark.multiproc


def test_silent_abort_is_relaunched_once(run_workers, tmp_path):
    results = run_workers("abort_once_worker.py", 2, [tmp_path / "marker"], timeout=120, tag="abort")
    assert [r["rank"] for r in results] == [0, 1]
    assert (tmp_path / "marker").exists(), "the first attempt must have aborted"


def test_python_error_is_not_retried(run_workers, tmp_path):
    with pytest.raises(LaunchError, match="a real bug") as error:
        run_workers("abort_once_worker.py", 2, [tmp_path / "marker", "--raise"], timeout=120, tag="raise")
    assert not error.value.silent_abort
