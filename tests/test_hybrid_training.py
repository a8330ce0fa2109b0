"""Fleet's hybrid engine trains a ColumnParallel/RowParallel `PipelineLayer` model on CPU processes.

Every layout loads the same single-card weights and reads the same global batches, so besides
agreeing across ranks, its losses must equal the single-process run (rtol 1e-5 after 3 AdamW steps).
Only the case the real models do not reach is kept here: a `PipelineLayer` at pp = 1 under pure data
parallelism, which fleet wraps in `NoPipelineParallel` (no gradient sync; `fleet_wrappers.wrap_model`).
Every other layout runs the real models (tests/test_llama_layouts.py, tests/test_trainer.py).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multiproc

RTOL = 1e-5

LAYOUTS = {"dp2": (2, ())}


@pytest.fixture(scope="module")
def single_card_losses(run_workers_module):
    (result,) = run_workers_module("tiny_pipe_worker.py", 1, tag="single")
    return np.asarray(result["losses"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_single_card(run_workers, single_card_losses, name):
    nproc, flags = LAYOUTS[name]
    results = run_workers("tiny_pipe_worker.py", nproc, flags, timeout=240)
    losses = np.asarray([r["losses"] for r in results])
    assert losses.shape == (nproc, 3)
    assert (losses == losses[0]).all(), f"{name}: ranks disagree on the loss: {losses.tolist()}"
    np.testing.assert_allclose(losses[0], single_card_losses, rtol=RTOL, err_msg=name)
    assert losses[0, -1] < losses[0, 0], "training did not lower the loss"
    coords = {tuple(sorted(r["coords"].items())) for r in results}
    assert len(coords) == nproc, "two ranks claimed the same (dp, sharding, tp, pp) coordinates"
