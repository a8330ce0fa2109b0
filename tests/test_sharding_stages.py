"""Sharding stage2 and stage3 (Paddle's group_sharded_parallel on CPU processes): the loss curve and
grad norm of single card, the states (and for stage3 the parameters) really partitioned, and the
unified checkpoint across stages and layouts.

Stage3 slices every parameter of more than `--stage3_segment_size` elements; the tests set it to
1024 so the test model's matrices are sliced and its norm weights stay whole (under tp2 one
projection also stays whole), covering both kinds.
"""

from __future__ import annotations

import pytest

from runs import (
    CONTINUED,
    HALF,
    MICRO1,
    PP2,
    RESUME_STEP,
    SHARDED_TP_PP_SAVING,
    SINGLE,
    TP2,
    Run,
    assert_continues_single_card,
    assert_trains_like,
    assert_written_as_planned,
    continued,
    history,
)

PARITY_RTOL = 1e-4  # the bound over 20 steps, kept over the 10 or 14 these runs train
RESUME_RTOL = 1e-5
SAVE = ("--save_steps", str(RESUME_STEP))
SEGMENT = ("--stage3_segment_size", "1024")


def sharded(stage: str, degree: int) -> tuple[str, ...]:
    return ("--sharding", stage, "--sharding_parallel_degree", str(degree)) + (SEGMENT if stage == "stage3" else ())


# A data degree of 4 on 4 ranks: micro-batches of 1 (MICRO1) keep the sharded gradients accumulating. Both
# stop early (their steps compared with single card's): stage2 at its step-10 save, stage3 after the 4 steps
# its same-layout resume is compared with.
STAGE2 = Run("dp2_sharding2_stage2", 4, sharded("stage2", 2) + MICRO1 + HALF)
STAGE3 = Run("sharding4_stage3", 4, sharded("stage3", 4) + MICRO1 + SAVE + (
    "--exit_after_steps", str(RESUME_STEP + CONTINUED)))
RESUMES = {  # the pairs: each continues the single-card curve from the step-10 checkpoint
    "sharding4_stage3->tp2pp2": Run("stage3_to_tp2pp2", 4, TP2 + PP2, resume_from=STAGE3),
    "sharding2_tp2_pp2_stage1->tp2_sharding2_stage3": Run("sharding2_tp2_pp2_to_tp2_stage3", 4, TP2 + sharded("stage3", 2),
                                           resume_from=SHARDED_TP_PP_SAVING),
    "dp2_sharding2_stage2->sharding4_stage2": Run("stage2_to_sharding4_stage2", 4, sharded("stage2", 4) + MICRO1,
                                                  resume_from=STAGE2),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("run", [STAGE2, STAGE3], ids=lambda run: run.tag)
def test_stage_trains_like_single_card(pretrain_run, run):
    """Clipping is active, and the norm is summed once over the sharding group (twice would be
    sqrt(2) off, never would be 1/sqrt(n) off)."""
    assert_trains_like(pretrain_run, run, SINGLE, PARITY_RTOL)


@pytest.mark.multiproc
def test_stage2_partitions_gradients_and_optimizer_states(pretrain_run):
    """Each sharding rank keeps the gradients and states of its own parameters only (stage1 would
    keep every gradient); the two of a dp replica together hold exactly single card's. Parameters
    stay whole (stage2 does not slice them)."""
    single = _held(pretrain_run, SINGLE)[0]
    held = _held(pretrain_run, STAGE2)  # ranks 0, 1: dp 0, sharding 0 and 1
    for rank in held:
        assert rank["parameters"] == single["parameters"]
        for kind in ("gradients", "optimizer_states"):
            assert 0.3 * single[kind] < rank[kind] < 0.7 * single[kind], f"{kind} are not partitioned"
    for kind in ("gradients", "optimizer_states"):
        assert held[0][kind] + held[1][kind] == single[kind]


@pytest.mark.multiproc
def test_stage3_partitions_parameters_and_states(pretrain_run):
    """Each of 4 sharding ranks holds a quarter of every sliced parameter (plus its padding to the
    4096-byte alignment) and the small ones whole, and the gradients and states of exactly that."""
    single = _held(pretrain_run, SINGLE)[0]
    held = _held(pretrain_run, STAGE3)
    for rank in held:
        whole = rank["whole_parameters"]
        assert whole < 0.01 * single["parameters"], "only the norm weights stay whole"
        sliced_share = (rank["parameters"] - whole) / (single["parameters"] - whole)
        assert 0.25 <= sliced_share < 0.26, f"stage3 holds {sliced_share:.4f} of the sliced parameters, not 1/4"
        # AdamW: two moments per element and two scalar beta powers per parameter
        assert 2 * rank["parameters"] < rank["optimizer_states"] < 2 * rank["parameters"] + 100
        assert rank["gradients"] == rank["parameters"], "each gradient is held as its parameter is: sliced or whole"


def _held(pretrain_run, run: Run) -> list[dict]:
    results, _ = pretrain_run(run)
    return [r["held_elements"] for r in sorted(results, key=lambda r: r["rank"])]


@pytest.mark.multiproc
@pytest.mark.parametrize("run", [STAGE2, STAGE3], ids=lambda run: run.tag)
def test_stage_save_is_spread_over_every_rank_as_the_planner_predicts(pretrain_run, run):
    """Stage2 states are written by the rank Paddle's stage2 partition gives them; under stage3 any
    rank can write a tensor its sharding group gathers from slices. The checkpoint verifies."""
    assert_written_as_planned(pretrain_run, run)


@pytest.mark.multiproc
@pytest.mark.parametrize("pair", list(RESUMES))
def test_resume_across_stages_continues_the_single_card_run(pretrain_run, pair):
    assert_continues_single_card(pretrain_run, RESUMES[pair], RESUME_RTOL)


@pytest.mark.multiproc
def test_same_layout_stage3_resume_is_bitwise(pretrain_run):
    uninterrupted = history(pretrain_run, STAGE3)
    result = history(pretrain_run, Run("stage3_same_layout", 4, sharded("stage3", 4) + MICRO1, resume_from=STAGE3))
    assert result["losses"] == continued(uninterrupted["losses"])
