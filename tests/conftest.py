"""Shared fixtures: real launches of the worker scripts in tests/workers and of run_pretrain.py."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
from moe_cases import FIVE_ONLY_KINDS, KINDS, PREDICTING

from checkpoint.format import tokenizer_files
from paddle_pp.runtime.launch import launch

import hf_models
from runs import CONTINUED, CORPUS, RESUME_STEP, TOKENIZER, Run, pretrain

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


def first_batch(data_cache: Path, tokenizer_dir: Path, max_steps: int, eval_steps: int = 0) -> np.ndarray:
    """The 8 samples step 1 of a `max_steps` run of the test model trains on, in PaddleNLP's sample
    order (which depends on the dataset's size, so on `max_steps`), with `tokenizer_dir`'s ids."""
    from paddle_pp.data.source import build_data, dataset_sizes, plan_data

    plan = plan_data("", CORPUS, tokenizer_dir, data_cache, "949,50,1", "mmap", 32, 42,
                     dataset_sizes(8, max_steps, eval_steps, 1), 4096)
    train, _ = build_data(plan)
    return np.stack([train[i] for i in range(8)]).astype(np.int64)


FOLDER_STEPS = 3  # steps of the runs that start from transformers 5 folders (their first batch is the reference's)
IDS = np.random.default_rng(11).integers(0, 4096, size=(2, 24))  # logits are compared on these


@pytest.fixture(scope="session")
def transformers4_folders(tmp_path_factory) -> Path:
    """Every model kind of `hf_models.KINDS` saved by transformers 4.x (this venv's), with its logits on
    IDS beside it, and the tokenizer its hub folder ships (`hf_models.KIND_TOKENIZERS`, else ours)."""
    root = tmp_path_factory.mktemp("transformers4")
    hf_models.make_with_answers(root, IDS[:, :9], IDS, list(hf_models.KINDS))
    tokenizers = {style: hf_models.hub_tokenizer(style, root / f"tokenizer_{style}", CORPUS)
                  for style in set(hf_models.KIND_TOKENIZERS.values())}
    for kind in hf_models.KINDS:
        source = tokenizers.get(hf_models.KIND_TOKENIZERS.get(kind), TOKENIZER)
        for path in tokenizer_files(source):
            shutil.copy(path, root / kind)
    return root


@pytest.fixture(scope="session")
def transformers5_folders(tmp_path_factory, data_cache) -> Path:
    """Every model kind of `hf_models.KINDS`, `HYBRID_KINDS`, `VARIANT_KINDS`, `DECLARED_KINDS` and `MULTIMODAL_KINDS` saved by transformers 5, with transformers
    5's loss on the first batch of a FOLDER_STEPS run and its logits on IDS beside each folder (one
    subprocess)."""
    root = tmp_path_factory.mktemp("transformers5")
    np.save(root / "rows.npy", first_batch(data_cache, TOKENIZER, FOLDER_STEPS))
    np.save(root / "ids.npy", IDS)
    kinds = [*hf_models.KINDS, *hf_models.HYBRID_KINDS, *hf_models.VARIANT_KINDS, *hf_models.DECLARED_KINDS,
             *hf_models.MULTIMODAL_KINDS]
    hf_models.transformers5("make", root, root / "rows.npy", root / "ids.npy", *kinds)
    for kind in kinds:
        shutil.copy(TOKENIZER / "tokenizer.model", root / kind)
    return root


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
            flags += ("--resume_from_checkpoint", str(saved / f"checkpoint-{RESUME_STEP}"), "--exit_after_steps",
                      str(CONTINUED))
        out = tmp_path_factory.mktemp(description.tag)
        return pretrain(launcher, data_cache, out, description.nproc, flags, description.tag, description.nnodes), out

    return run


@pytest.fixture(scope="session")
def moe_folders(tmp_path_factory, data_cache) -> dict:
    """Each MoE kind saved by transformers 4.55 (this venv's) and 5.23 (one subprocess), and the hybrid
    MoE kinds by 5.23 only, with that version's logits on IDS and loss on the first batch of a
    FOLDER_STEPS run beside it."""
    rows = first_batch(data_cache, TOKENIZER, FOLDER_STEPS)
    roots = {version: tmp_path_factory.mktemp(f"moe_{version}") for version in ("transformers4", "transformers5")}
    hf_models.make_with_answers(roots["transformers4"], rows, IDS, KINDS)
    np.save(roots["transformers5"] / "rows.npy", rows)
    np.save(roots["transformers5"] / "ids.npy", IDS)
    hf_models.transformers5("make", roots["transformers5"], roots["transformers5"] / "rows.npy",
                            roots["transformers5"] / "ids.npy", *KINDS, *FIVE_ONLY_KINDS)
    for root, kinds in ((roots["transformers4"], KINDS), (roots["transformers5"], KINDS + FIVE_ONLY_KINDS)):
        for kind in kinds:
            for path in tokenizer_files(TOKENIZER):
                shutil.copy(path, root / kind)
    for predicting, (kind, depth) in PREDICTING.items():
        shutil.copytree(roots["transformers5"] / kind, roots["transformers5"] / predicting)
        hf_models.transformers5("with_prediction_layers", roots["transformers5"] / predicting, depth,
                                roots["transformers5"] / "rows.npy", roots["transformers5"] / "ids.npy")
    return roots
