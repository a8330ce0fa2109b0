"""Run model_worker.py in a layout and compare it with the single-card run: the shared parity check."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import numpy as np
import paddle

from modeling.execution import Execution
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained

EVAL_RTOL, TRAIN_TOL = 1e-6, 1e-5


def write_model_files(base: Path, model_type: str, config: dict, model_class) -> Path:
    """The single-card initial weights (init.npz) and HF-style config.json every layout starts from."""
    paddle.seed(0)
    model = model_class(model_class.config_class(**config))
    np.savez(base / "init.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    (base / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    return base


def run_model(run, files: Path, nproc: int, flags: list, tag: str) -> tuple[list[dict], dict[str, np.ndarray]]:
    out = files / f"{tag}.npz"
    results = run("model_worker.py", nproc, [*flags, "--config", files / "config.json", "--init", files / "init.npz",
                                             "--out", out], timeout=300, tag=tag)
    return results, dict(np.load(out))


def layout_runs(run, files: Path, layouts: dict[str, tuple[int, tuple]], single_flags: tuple = ()) -> Callable:
    """`get(name)`: the model worker's run of `layouts[name]` (nproc, flags), or of "single" (one
    process with `single_flags`), each launched once, when a test first asks for it."""

    @functools.cache
    def get(name: str):
        nproc, flags = (1, single_flags) if name == "single" else layouts[name]
        return run_model(run, files, nproc, flags, name)

    return get


def assert_matches(name: str, run_result, reference) -> None:
    """Every rank agrees; eval loss within EVAL_RTOL; losses and every gathered parameter within TRAIN_TOL."""
    results, params = run_result
    (ref_result,), ref_params = reference
    assert len({tuple(r["losses"]) for r in results}) == 1, f"{name}: ranks disagree"
    np.testing.assert_allclose(results[0]["eval_loss"], ref_result["eval_loss"], rtol=EVAL_RTOL)
    np.testing.assert_allclose(results[0]["losses"], ref_result["losses"], rtol=TRAIN_TOL)
    assert sorted(params) == sorted(ref_params), f"{name}: gathered names differ from single card"
    for key, value in ref_params.items():
        np.testing.assert_allclose(params[key], value, rtol=TRAIN_TOL, atol=TRAIN_TOL, err_msg=f"{name}: {key}")


def assert_same_logits(ours, theirs, vocab_size: int, seed: int, rtol: float = 1e-6) -> None:
    """Both models in eval mode give the same logits on one random batch (PaddleNLP's may return a tuple)."""
    ours.eval(), theirs.eval()
    ids = paddle.to_tensor(np.random.default_rng(seed).integers(0, vocab_size, size=(2, 12)))
    theirs_logits = theirs(ids)
    theirs_logits = theirs_logits[0] if isinstance(theirs_logits, (tuple, list)) else theirs_logits
    np.testing.assert_allclose(ours(ids).numpy(), theirs_logits.numpy(), rtol=rtol, atol=rtol)


def our_model(folder: Path, run: Execution | None = None):
    """Our single-card model of `folder` computed as `run` says, its weights read as
    --model_name_or_path reads them."""
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config, run)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    return model


def our_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """`our_model`'s logits on `ids` in eval mode."""
    model = our_model(folder)
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()
