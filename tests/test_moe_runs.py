"""Mixture-of-experts training across layouts (real processes, fp32): a DeepSeek-V3-shaped model
trains like single card under cp2 x sharding2 stage1 x ep2 and sharding2 stage2 without ep; its cp2 x
ep2 checkpoint resumes on that curve under dp2 x sharding2 stage1 with ep4 (experts across the sharding
ranks) and on one card, and after a kill mid-save on
one card; a Switch-routed Qwen2-MoE trains like single card with its sequences cut over cp.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FOLDER_STEPS
from moe_cases import (
    DEEPSEEK,
    EP2,
    EP4,
    LOSS_RTOL,
    MTP_KIND,
    PARITY_RTOL,
    RESUME_RTOL,
    ROUTING_NOISE,
    counting_an_absent_prediction_layer,
    start_flags,
)

from paddle_pp.runtime.launch import LaunchError, launch

from runs import (
    CONTINUED,
    HALF,
    MICRO4,
    MODEL,
    RESUME_STEP,
    TRAINER,
    Run,
    assert_trains_like,
    assert_written_as_planned,
    continued,
    history,
)

RESUMED_SAVE = RESUME_STEP + CONTINUED  # the resumed ep4 run's last step, saved


@pytest.fixture(scope="module")
def moe_runs(moe_folders):
    """A DeepSeek-V3-shaped model (latent attention with yarn, a dense first layer, then 8 experts in 2
    groups with sigmoid routing, correction biases and a shared expert; a multi-token prediction
    layer) from its transformers 5 folder: 20 steps on one card, and the first 10 of them (saving at
    step 10) under each of these layouts: under cp2 x sharding2 stage1 over ep2 with full recompute, a
    micro-batch of 4 a step (each expert's states on one of its two replicas, the cp peers); under
    sharding2 stage2 without ep (2 ranks, each accumulating two micro-batches of 2 a step); and the cp2 x
    ep2 step-10 checkpoint resumed under dp2 x sharding2 stage1 over ep4 (the expert group across the
    sharding ranks, two experts per rank, each rank updating its own experts outside stage1's
    partition; saving at step 14) and on one card. (dp2 x sharding2 stage1 over ep4 trained 10 steps of
    its own too, retired: its resume trains that layout on the curve and its save is checked. Its layers under pp with
    tp, SP and ep beside them: the MoE starts' split layout, this folder on 8 ranks,
    tests/test_moe_starts.py; with recompute there too: DeepSeek-V3.2's 10 steps,
    tests/test_sparse_training.py, which retired this suite's dp2 x pp2 x ep2 run. ep2 over the data
    replicas of dp2 x sharding2 stage1 was a run of its own: the split layout's ep2 across dp2 and the
    cp2 one cover its placement, its recompute moved to the latter.)"""
    start = start_flags(MTP_KIND, moe_folders["transformers5"]) + DEEPSEEK
    single = Run("deepseek_single", 1, start + ("--save_steps", str(RESUME_STEP)))
    saved = Run("deepseek_ep2_cp2_stage1_recompute", 4, start + EP2 + MICRO4 + HALF + (
        "--context_parallel_degree", "2", "--sharding_parallel_degree", "2", "--sharding", "stage1", "--recompute"))
    return {"single": single, "ep2_cp2_stage1": saved,
            "stage2": Run("deepseek_sharding2_stage2", 2, start + HALF + (
                "--sharding_parallel_degree", "2", "--sharding", "stage2", "--recompute")),
            "resumed_ep4": Run("deepseek_resumed_ep4_stage1", 4, start + EP4 + (
                "--sharding_parallel_degree", "2", "--sharding", "stage1", "--save_steps", str(RESUMED_SAVE)),
                resume_from=saved),
            "resumed_single": Run("deepseek_resumed_single", 1, start, resume_from=saved)}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["ep2_cp2_stage1", "stage2"])
def test_a_deepseek_v3_shaped_model_trains_like_single_card(layout, moe_runs, pretrain_run, moe_folders):
    """Losses, evaluation, grad norms, aux losses, multi-token prediction losses and step-10 weights (the
    correction biases, moved every step by the balancing rule, and the prediction layer on the last
    pipeline stage among them) on the single-card run's; step 1 is transformers 5's next-token loss
    plus MtpModel's on the same batch, and its logged mtp_loss MtpModel's; the model learns. First,
    every token of the 20 steps routed clear of a tie by more than the layouts' summation noise
    (sigmoid scores do come near one: 2.5e-6 measured here)."""
    single = history(pretrain_run, moe_runs["single"])
    assert min(single["router_margins"]) > ROUTING_NOISE, "a token came within summation noise of a routing tie: " \
        "another layout may route it elsewhere; reseed the test folders (hf_models.SEEDS)"
    answers = np.load(f"{moe_folders['transformers5'] / MTP_KIND}.mtp.npz")
    np.testing.assert_allclose(single["losses"][0], answers["loss"] + answers["mtp_losses"].mean(), rtol=LOSS_RTOL)
    np.testing.assert_allclose(single["mtp_losses"][0], answers["mtp_losses"].mean(), rtol=LOSS_RTOL)
    assert_trains_like(pretrain_run, moe_runs[layout], moe_runs["single"], PARITY_RTOL)
    for metric in ("aux_losses", "mtp_losses"):
        logged = history(pretrain_run, moe_runs[layout])[metric]
        np.testing.assert_allclose(logged, single[metric][:len(logged)], rtol=PARITY_RTOL)
    assert single["losses"][-1] < single["losses"][0] - 0.5, "the model learns"


@pytest.mark.multiproc
@pytest.mark.parametrize("resumed", ["resumed_ep4", "resumed_single"])
def test_a_deepseek_checkpoint_resumes_across_expert_parallel_sizes_on_the_single_card_curve(resumed, moe_runs,
                                                                                              pretrain_run):
    """The cp2 x ep2 checkpoint (each expert written by one of the ranks holding it, the correction biases
    beside their routers, all under single-card names) gives every rank of ep4, and one card, exactly
    its weights, biases and Adam states before the first step, and the run continues on the
    uninterrupted single-card curve."""
    results, _ = pretrain_run(moe_runs[resumed])
    assert [r["resumed_exactly"] for r in results] == [True] * len(results)
    single = history(pretrain_run, moe_runs["single"])
    np.testing.assert_allclose(history(pretrain_run, moe_runs[resumed])["losses"], continued(single["losses"]),
                               rtol=RESUME_RTOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, step", [("resumed_ep4", RESUMED_SAVE), ("ep2_cp2_stage1", RESUME_STEP)])
def test_an_expert_parallel_save_is_written_by_every_rank_as_the_planner_predicts(layout, step, moe_runs, pretrain_run):
    """Each expert's tensors come from one of the ranks holding it (the planner's writer for each;
    with experts across sharding ranks, its AdamW states from the replica updating it, outside
    stage1's partition, the cp peers among the replicas), every rank writes a share, and the
    checkpoint verifies."""
    assert_written_as_planned(pretrain_run, moe_runs[layout], step)


@pytest.mark.multiproc
def test_a_kill_during_an_expert_parallel_save_leaves_the_last_checkpoint_resumable(moe_runs, moe_folders, pretrain_run,
                                                                                     data_cache, tmp_path):
    """Four ranks (dp4: each expert on 2 of them, so their gradients are summed over the replicas)
    train 2 steps on the single-card curve, then die while writing the step-4 save; checkpoint-2
    resumes on one card with exactly its weights and Adam states and continues on the curve."""
    out = tmp_path / "out"
    common = [*MODEL, *start_flags(MTP_KIND, moe_folders["transformers5"]), *DEEPSEEK, "--save_steps", "2",
              "--data_cache", str(data_cache), "--output_dir", str(out)]
    with pytest.raises(LaunchError):
        launch(TRAINER.parent / "killed_save_worker.py", 4, [*common, *EP2], work_dir=tmp_path / "killed", timeout=300)
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert (out / ".tmp-checkpoint-4").is_dir() and not (out / "checkpoint-4").exists()
    killed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][:2]
    single = history(pretrain_run, moe_runs["single"])
    np.testing.assert_allclose([r["loss"] for r in killed], single["losses"][:2], rtol=RESUME_RTOL)
    np.testing.assert_allclose([r["grad_norm"] for r in killed], single["grad_norms"][:2], rtol=RESUME_RTOL)
    resumed = launch(TRAINER, 1, [*common, "--resume_from_checkpoint", "latest", "--exit_after_steps", "2"],
                     work_dir=tmp_path / "resumed", timeout=300)
    assert resumed[0]["resumed_exactly"] is True
    np.testing.assert_allclose(resumed[0]["losses"], single["losses"][2:4], rtol=RESUME_RTOL)


@pytest.mark.multiproc
def test_a_folder_without_its_counted_prediction_layer_trains_one_from_fresh_weights(moe_folders, data_cache,
                                                                                      tmp_path):
    """--fresh_prediction_layers on a DeepSeek-V3 folder transformers saved, its config counting a
    prediction layer it does not hold: one card trains the layer beside the model it read. Step 1's loss
    is transformers' next-token loss on the batch plus the fresh layer's logged loss, and the checkpoint
    holds the layer."""
    root = moe_folders["transformers5"]
    folder = counting_an_absent_prediction_layer(root / "deepseek_v3", tmp_path / "deepseek_v3")
    out = tmp_path / "out"
    (result,) = launch(TRAINER, 1, [*MODEL, "--model_name_or_path", str(folder), *DEEPSEEK, "--fresh_prediction_layers",
                                    "--max_steps", str(FOLDER_STEPS), "--eval_steps", "0", "--warmup_steps", "1",
                                    "--save_steps", str(FOLDER_STEPS), "--data_cache", str(data_cache),
                                    "--output_dir", str(out)], work_dir=tmp_path / "job", timeout=300)
    expected = json.loads((root / "deepseek_v3.json").read_text())["loss"]
    assert result["mtp_losses"][0] > 1.0, "the fresh layer predicts no better than chance"
    np.testing.assert_allclose(result["losses"][0] - result["mtp_losses"][0], expected, rtol=LOSS_RTOL)
    index = json.loads((out / f"checkpoint-{FOLDER_STEPS}" / "model.safetensors.index.json").read_text())
    assert "deepseek_v3.layers.4.eh_proj.weight" in index["weight_map"]


@pytest.fixture(scope="module")
def switch_runs(moe_folders):
    """Qwen2-MoE (softmax router with the Switch aux loss, a gated shared expert, a dense layer) from
    its transformers 5 folder, two rows per micro-batch (four a step on one card, two on each data rank):
    20 steps on one card, the first 10 under cp2 x dp2 x ep2 (both saving at step 10)."""
    start = start_flags("qwen2_moe", moe_folders["transformers5"])
    return {"single": Run("qwen2_moe_single", 1, start + ("--save_steps", str(RESUME_STEP))),
            "cp2_ep2": Run("qwen2_moe_cp2_ep2", 4, start + EP2 + HALF + ("--context_parallel_degree", "2"))}


@pytest.mark.multiproc
def test_a_switch_routed_model_trains_like_single_card_with_its_sequences_cut_over_cp(switch_runs, pretrain_run):
    """The Switch aux loss is a statistic of the whole micro-batch: under cp each rank routes half of
    every sequence and the counts and mean scores are pooled over the ring before the product, so
    the aux losses, losses, grad norms and step-10 weights are one card's (1e-4), experts over ep2."""
    single = history(pretrain_run, switch_runs["single"])
    assert min(single["router_margins"]) > ROUTING_NOISE, "a token came within summation noise of a routing tie"
    assert min(single["aux_losses"]) > 0
    logged = history(pretrain_run, switch_runs["cp2_ep2"])["aux_losses"]
    np.testing.assert_allclose(logged, single["aux_losses"][:len(logged)], rtol=PARITY_RTOL)
    assert_trains_like(pretrain_run, switch_runs["cp2_ep2"], switch_runs["single"], PARITY_RTOL)


