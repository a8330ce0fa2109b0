"""Shared fixtures: the worker scripts live in tests/workers and are importable for their case builders."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))


def _launcher(base: Path):
    from paddle_pp.launch import launch

    def run(script: str, nproc: int, args=(), timeout: float = 300.0, nnodes: int = 1, tag: str = "job"):
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
    """The shipped corpus tokenized once per session (runs then skip preprocessing)."""
    from pretrain_case import CORPUS, TOKENIZER

    from paddle_pp.data.tokens import preprocess

    prefix = tmp_path_factory.mktemp("data") / "jargon"
    preprocess(CORPUS, TOKENIZER, prefix)
    return prefix


@pytest.fixture(scope="session")
def pretrain_run(tmp_path_factory, data_cache):
    """run_pretrain.py launched once per (tag, ranks, flags) for the whole session, so trainer and
    checkpoint tests share their most expensive runs: (per-rank results, output dir)."""
    from pretrain_case import pretrain

    launcher = _launcher(tmp_path_factory.mktemp("pretrain_jobs"))

    @functools.cache
    def run(tag: str, nproc: int, flags: tuple[str, ...], nnodes: int = 1):
        out = tmp_path_factory.mktemp(tag)
        return pretrain(launcher, data_cache, out, nproc, list(flags), tag, nnodes), out

    return run
