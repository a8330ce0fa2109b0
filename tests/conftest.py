"""Shared fixtures: the worker scripts live in tests/workers and are importable for their case builders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))


@pytest.fixture
def run_workers(tmp_path):
    """Launch a worker script in real processes and return the per-rank JSON results."""
    from paddle_pp.launch import launch

    def _run(script: str, nproc: int, args=(), timeout: float = 300.0, nnodes: int = 1, tag: str = "job"):
        return launch(WORKERS / script, nproc, list(args), work_dir=tmp_path / tag, timeout=timeout, nnodes=nnodes)

    return _run
