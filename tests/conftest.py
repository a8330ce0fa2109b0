"""Shared fixtures: real launches of the worker scripts in tests/workers and of run_pretrain.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from runs import CORPUS, RESUME_STEP, TOKENIZER, Run, pretrain

from paddle_pp.runtime.launch import launch

WORKERS = Path(__file__).parent / "workers"


def _launcher(base: Path):
    def run(script: str | Path, nproc: int, args=(), timeout: float = 300.0, nnodes: int = 1, tag: str = "job"):
        return launch(WORKERS / script, nproc, list(args), work_dir=base / tag, timeout=timeout, nnodes=nnodes,
                      retries_on_silent_abort=1)

    return run


@pytest.fixture
def run_workers(tmp_path):
    """Launch a worker script in real processes and return the per-rank JSON results."""
    return _launcher(tmp_path)


@pytest.fixture(scope="module")
def run_workers_module(tmp_path_factory):
    """`run_workers` for module-scoped references shared by several tests."""
    return _launcher(tmp_path_factory.mktemp("module_jobs"))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """A --data_cache folder holding the shipped corpus tokenized once per session (runs then skip
    preprocessing; their index files accumulate here too)."""
    from paddle_pp.data.preprocess import ensure_corpus

    folder = tmp_path_factory.mktemp("data")
    ensure_corpus(CORPUS, TOKENIZER, folder)
    return folder


@pytest.fixture(scope="session")
def pretrain_run(tmp_path_factory, data_cache):
    """Each `Run` launched once for the whole session, so trainer and checkpoint tests share their
    most expensive runs: (per-rank results, output dir)."""
    launcher = _launcher(tmp_path_factory.mktemp("pretrain_jobs"))

    @functools.cache
    def run(description: Run):
        flags = description.flags
        if description.resume_from is not None:
            _, saved = run(description.resume_from)
            flags += ("--resume_from_checkpoint", str(saved / f"checkpoint-{RESUME_STEP}"))
        out = tmp_path_factory.mktemp(description.tag)
        return pretrain(launcher, data_cache, out, description.nproc, flags, description.tag, description.nnodes), out

    return run
