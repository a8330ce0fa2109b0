"""Fleet's hybrid engine trains a ColumnParallel/RowParallel `PipelineLayer` model on CPU processes.

Every layout loads the same single-card weights and reads the same global batches, so besides
agreeing across ranks, its losses must equal the single-process run (rtol 1e-5 after 3 AdamW steps).
"""

from __future__ import annotations

import numpy as np
import pytest

from runs import PP2, SHARDING2, TP2

pytestmark = pytest.mark.multiproc

RTOL = 1e-5

LAYOUTS = {
    "dp2": (2, ()),
    "sharding2": (2, SHARDING2),
    "tp2": (2, TP2),
    "pp2": (2, PP2),
    "tp2pp2": (4, TP2 + PP2),
    "dp2_sharding2_tp2_pp2": (16, TP2 + PP2 + SHARDING2),
}


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
