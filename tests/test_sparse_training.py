"""DeepSeek Sparse Attention trained in the DeepSeek-V3.2 report's two stages (real processes, fp32): a
DeepSeek-V3.2-shaped model from its transformers 5 folder (each query's 8 of 32 keys) warms its indexers
up for 5 steps (every key attended, every other weight frozen), then trains sparse, 20 steps in all, on
one card and under ep2 x dp2 x tp2 x pp2 + SP recomputing whole layers on the same curve, its
checkpoint written as the planner says; its step-10 checkpoint resumes under tp2 x sharding2 stage3 on
it. (Its start at transformers' loss in the sparse stage, and GLM-5.2's shared selections across a
stage: tests/test_moe_starts.py; stage1 beside ep: DeepSeek-V3's resume in tests/test_moe_runs.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from moe_cases import DEEPSEEK, DP2_TP2_PP2_SP, EP2, PARITY_RTOL, RESUME_RTOL, start_flags

from modeling.blocks.indexer import is_indexer_parameter
from modeling.registry import config_from_dict, plan_of
from paddle_pp.interop.pretrained import open_pretrained

from runs import (
    RESUME_STEP,
    TP2,
    Run,
    assert_trains_like,
    assert_written_as_planned,
    continued,
    history,
)

pytestmark = pytest.mark.multiproc

WARMUP = 5
# the KL is cross-entropy minus entropy (about log 8 nats each here) and near 0 at these weights (4e-5): its
# layouts' fp32 difference is absolute (3.5e-9 measured)
KL_ATOL = 1e-7
WARMING = ("--indexer_dense_warmup_steps", str(WARMUP))


@pytest.fixture(scope="module")
def sparse_runs(moe_folders):
    start = start_flags("deepseek_v32", moe_folders["transformers5"]) + DEEPSEEK + WARMING
    single = Run("dsa_single", 1, start + ("--save_steps", str(WARMUP)))
    split = Run("dsa_ep2_dp2_tp2_pp2_sp_recompute", 8, start + EP2 + DP2_TP2_PP2_SP + (
        "--save_steps", str(RESUME_STEP), "--recompute"))
    # past the warm-up, resumed without it: stage2/3 refuse a warm-up (their wrappers fix the trained weights)
    resumed = Run("dsa_resumed_tp2_sharding2_stage3", 4, start_flags("deepseek_v32", moe_folders["transformers5"]) +
                  DEEPSEEK + TP2 + ("--sharding_parallel_degree", "2", "--sharding", "stage3"), resume_from=split)
    return {"single": single, "split": split, "resumed": resumed}


def test_the_warm_up_trains_the_indexers_alone_and_the_sparse_stage_everything_like_single_card(
        sparse_runs, pretrain_run, moe_folders):
    """After the 5 warm-up steps every weight but the indexers' is the folder's, bit for bit, and every
    indexer weight has moved; the 8-rank run's 20 steps (5 warm-up, 15 sparse) have the single card's
    losses, grad norms and indexer losses (1e-4, or 1e-7 absolute) and its step-10 weights (1e-4; by step
    20 Adam has turned the layouts' summation noise in near-zero gradients into lr-sized moves: 1e-3 in
    the embeddings and the indexers alike, measured, the curves still within 1e-4)."""
    _, out = pretrain_run(sparse_runs["single"])
    folder, warmed = (open_pretrained(path) for path in (moe_folders["transformers5"] / "deepseek_v32",
                                                          out / f"checkpoint-{WARMUP}"))
    names = list(plan_of(config_from_dict(warmed.config)))
    indexers = [name for name in names if is_indexer_parameter(name)]
    assert indexers
    for name in names:
        before, after = folder.read(name, None, 1, 0), warmed.read(name, None, 1, 0)
        if name in indexers:
            assert np.abs(after - before).max() > 0, f"{name} did not train in the warm-up"
        else:
            np.testing.assert_array_equal(after, before, err_msg=f"{name} moved in the warm-up")
    assert_trains_like(pretrain_run, sparse_runs["split"], sparse_runs["single"], PARITY_RTOL, weights_at=RESUME_STEP)
    single, split = (history(pretrain_run, sparse_runs[name]) for name in ("single", "split"))
    assert all(loss is not None for loss in single["indexer_losses"])
    np.testing.assert_allclose(split["indexer_losses"], single["indexer_losses"][:len(split["indexer_losses"])],
                               rtol=PARITY_RTOL, atol=KL_ATOL)


def test_the_sparse_attention_save_is_written_by_every_rank_as_the_planner_predicts(sparse_runs, pretrain_run):
    """The 8-rank run's step-10 checkpoint: each expert's tensors from one of the ranks holding it, the
    indexers (whole on every tp rank) once, by the planner's writer of each; every rank writes a share and
    the checkpoint verifies."""
    assert_written_as_planned(pretrain_run, sparse_runs["split"])


def test_a_sparse_stage_checkpoint_resumes_under_another_layout_on_the_single_card_curve(sparse_runs, pretrain_run):
    """The 8-rank run's step-10 checkpoint (the optimizer's states of the weights the warm-up froze made
    when it ended) continues under tp2 x sharding2 stage3 (every weight, the indexers' among them, sliced
    over the sharding ranks) on the uninterrupted single card's losses (1e-5) and indexer losses (1e-5,
    or 1e-7 absolute)."""
    single, resumed = (history(pretrain_run, sparse_runs[name]) for name in ("single", "resumed"))
    np.testing.assert_allclose(resumed["losses"], continued(single["losses"]), rtol=RESUME_RTOL)
    np.testing.assert_allclose(resumed["indexer_losses"], continued(single["indexer_losses"]), rtol=RESUME_RTOL,
                               atol=KL_ATOL)
