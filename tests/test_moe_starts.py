"""Every MoE family's folders started by the trainer (real processes, fp32): on one card at the loss
of the transformers that saved them, under ep2 x dp2 x tp2 x pp2 + SP at that loss and on the
single-card curve; the correction biases move by the balancing rule on every rank; the checkpoints
load in both transformers versions as saved and exported; multi-token prediction trains under the
split layout like single card and its checkpoint keeps the prediction layer as released folders do.
"""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest
from conftest import IDS
from moe_cases import (
    DP2_TP2_PP2_SP,
    EP2,
    EXPORT_TOL,
    FIVE_ONLY_KINDS,
    KINDS,
    LOGITS_TOL,
    LOSS_RTOL,
    MTP_KIND,
    PARITY_RTOL,
    RESUME_RTOL,
    SPLIT_KINDS,
    SPLIT_VERSION,
    VERSIONS,
    our_model,
    predictions,
)

from modeling.registry import config_from_dict, plan_of
from paddle_pp.interop.pretrained import open_pretrained
from paddle_pp.interop.transformers import export_hf

import hf_models
from parity import our_logits

EXPERT_COUNT_FIELD = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts", "mixtral": "num_local_experts",
                      "olmoe": "num_experts", "deepseek_v3": "n_routed_experts", "deepseek_v2": "n_routed_experts",
                      "glm4_moe": "n_routed_experts", "gpt_oss": "num_local_experts", "ernie4_5_moe": "moe_num_experts"}


@pytest.fixture(scope="module")
def moe_starts(moe_folders, run_workers_module, tmp_path_factory):
    """Every MoE kind started in one launch per layout (`workers/folders_worker.py`): from transformers
    5's folders under ep2 x dp2 x tp2 x pp2 + SP (8 ranks; its checkpoints saved in transformers' layout;
    experts under recompute: tests/test_moe_runs.py, recurrent layers: the hybrids' tp2 x pp2 runs in
    tests/test_family_training.py), from both versions' on one card, both with one row per micro-batch
    (the Switch aux loss is a micro-batch's statistic; with two rows GPT-OSS's expert biases, whose
    gradients are near zero, drift 2.2e-4 apart after Adam's two steps). A 4.x folder differs from a 5 one in its
    config's spelling and its weights, both read before any layout is applied: its start under the
    split layout would run the 5 folder's code paths again (and cost 7 s a folder on 8 ranks here), as
    would plain DeepSeek-V3's and Mixtral's (`SPLIT_KINDS`).
    Per layout: (the results by folder name `<kind>-<version>`, the folder of their checkpoints)."""
    links = tmp_path_factory.mktemp("moe_starts")
    folders = {version: [] for version in VERSIONS}
    for kind, version in [(kind, version) for kind in KINDS for version in VERSIONS] + \
            [(kind, SPLIT_VERSION) for kind in (MTP_KIND, *FIVE_ONLY_KINDS)]:
        (links / f"{kind}-{version}").symlink_to(moe_folders[version] / kind)
        folders[version].append(links / f"{kind}-{version}")
    split = [links / f"{kind}-{SPLIT_VERSION}" for kind in (*SPLIT_KINDS, MTP_KIND, *FIVE_ONLY_KINDS)]
    rows = moe_folders["transformers5"] / "rows.npy"
    started = {}
    for name, nproc, started_folders, layout in (
            ("split", 8, split, (*EP2, *DP2_TP2_PP2_SP, "--save_to_hf")),
            ("single", 1, [folder for version in VERSIONS for folder in folders[version]], ())):
        results = run_workers_module("folders_worker.py", nproc, [rows, links / name, 8, *started_folders, *layout,
                                                                  "--micro_batch_size", 1],
                                     timeout=900, tag=f"moe_starts_{name}")
        assert len({json.dumps({k: v["losses"] for k, v in r["folders"].items()}) for r in results}) == 1
        started[name] = (results, links / name)
    return started


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_folder_of_either_transformers_starts_on_one_card_at_its_loss(kind, moe_starts, moe_folders):
    """Both versions' folders of every family start on one card at the loss of the transformers that
    saved them."""
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    single, _ = moe_starts["single"]
    expected = {"transformers5": json.loads((moe_folders["transformers5"] / f"{kind}.json").read_text())["loss"],
                "transformers4": hf_models.loss(moe_folders["transformers4"] / kind, rows)}
    for version in VERSIONS:
        np.testing.assert_allclose(single[0]["folders"][f"{kind}-{version}"]["loss"], expected[version],
                                   rtol=LOSS_RTOL, err_msg=version)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", SPLIT_KINDS)
def test_an_moe_folder_starts_under_ep2_tp2_pp2_sp_at_its_loss_and_trains_like_single_card(
        kind, moe_starts, moe_folders, transformers5_checkpoint_logits, tmp_path):
    """transformers 5's folder of each family the split layout starts (Qwen3-MoE's per-head q/k norms,
    OLMoE's split over tp, V2's greedy groups, GLM-4.5's, GPT-OSS's sinks and stacked experts;
    DeepSeek-V3's latent attention with sigmoid group-limited routing and correction biases that change
    the choice: its folder with a prediction layer, below) under ep2 x dp2 x tp2 x pp2 + SP at
    transformers' loss, and its two steps and the checkpoint's weights are one card's (every q/k norm
    and correction bias to 1e-5; other weights to 1e-4: Adam's first steps turn near-zero gradients'
    summation noise into lr-sized moves); the checkpoint, saved in transformers' layout, holds the
    tensors and config.json of one card's export, and transformers 5.23 loads it with our logits."""
    name = f"{kind}-{SPLIT_VERSION}"
    expected = json.loads((moe_folders[SPLIT_VERSION] / f"{kind}.json").read_text())["loss"]
    _split_starts_at_and_trains_like_single_card(moe_starts, name, expected)
    (_, out), (_, single_out) = moe_starts["split"], moe_starts["single"]
    checkpoint, export = out / name / "checkpoint-2", export_hf(single_out / name / "checkpoint-2", tmp_path / name)
    assert json.loads((checkpoint / "config.json").read_text()) == json.loads((export / "config.json").read_text())
    assert _stored_names(checkpoint) == _stored_names(export) == _stored_names(moe_folders[SPLIT_VERSION] / kind)
    np.testing.assert_allclose(transformers5_checkpoint_logits[name], our_logits(checkpoint, IDS), atol=EXPORT_TOL,
                               rtol=EXPORT_TOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", FIVE_ONLY_KINDS)
def test_a_hybrid_moe_folder_starts_under_ep2_tp2_pp2_sp_at_its_loss_and_trains_like_single_card(
        kind, moe_starts, moe_folders, transformers5_checkpoint_logits, tmp_path):
    """Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet and gated attention layers, one of each per stage,
    their experts over ep2 and a gated shared expert), Kimi Linear (Kimi Delta Attention beside
    latent attention without rotary, DeepSeek-V3's experts after a dense layer), Nemotron 3's layers
    (Mamba-2, attention without rotary and latent ReLU^2 experts, one of each per stage; tp over the
    Mamba groups), Granite 4.0-H (Mamba-2 and NoPE attention, its multipliers, GraniteMoE's experts
    beside a shared MLP), GLM-4.7-Flash (latent attention, V3 routing, a dense layer on each stage as
    its mlp_layer_types says), Llama 4 (chunks of 8 of 32 tokens on its rotary layers, temperature-tuned NoPE
    layers, input-scaled top-1 experts beside a shared expert), Mistral 4 (latent attention with queries
    scaled by position, softmax groups) and Hunyuan-A13B (q/k norms after the rotary, an ungated shared MLP)
    from transformers 5's folders: on one card and under ep2 x dp2 x tp2 x pp2 + SP at
    transformers' loss (1e-5); the split layout's two steps and checkpoint are one card's, and
    transformers 5 loads that checkpoint (in its layout: Qwen's q, k, v and their convs fused again,
    Kimi's stored apart, the Mamba-2 in_proj and conv1d fused, Granite's experts stacked, with its
    tensor names) with our logits (1e-4)."""
    expected = json.loads((moe_folders[SPLIT_VERSION] / f"{kind}.json").read_text())["loss"]
    single, _ = moe_starts["single"]
    name = f"{kind}-{SPLIT_VERSION}"
    np.testing.assert_allclose(single[0]["folders"][name]["loss"], expected, rtol=LOSS_RTOL)
    _split_starts_at_and_trains_like_single_card(moe_starts, name, expected)
    checkpoint = moe_starts["split"][1] / name / "checkpoint-2"
    assert _stored_names(checkpoint) == _stored_names(moe_folders[SPLIT_VERSION] / kind)
    np.testing.assert_allclose(transformers5_checkpoint_logits[name], our_logits(checkpoint, IDS), atol=EXPORT_TOL,
                               rtol=EXPORT_TOL)


def _split_starts_at_and_trains_like_single_card(moe_starts, name: str, expected: float) -> None:
    """The split start of folder `name`: its loss is `expected`, its two training losses one card's,
    and so are its checkpoint's weights (every q/k norm and correction bias to 1e-5; other weights
    to 1e-4)."""
    (split, split_out), (single, single_out) = moe_starts["split"], moe_starts["single"]
    np.testing.assert_allclose(split[0]["folders"][name]["loss"], expected, rtol=LOSS_RTOL)
    np.testing.assert_allclose(split[0]["folders"][name]["losses"], single[0]["folders"][name]["losses"],
                               rtol=RESUME_RTOL)
    weights = [open_pretrained(out / name / "checkpoint-2") for out in (split_out, single_out)]
    for tensor in plan_of(config_from_dict(weights[1].config)):  # the split one's in transformers' layout
        got, reference = weights[0].read(tensor, None, 1, 0), weights[1].read(tensor, None, 1, 0)
        drift = np.linalg.norm(got - reference) / max(np.linalg.norm(reference), 1e-12)
        exact = tensor.endswith(("q_norm.weight", "k_norm.weight", "e_score_correction_bias"))
        assert drift < (RESUME_RTOL if exact else PARITY_RTOL), f"{name} {tensor}: {drift:.2g}"


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["glm4_moe", "ernie4_5_moe", MTP_KIND])
def test_the_correction_bias_moves_by_the_rule_from_the_steps_global_counts_on_every_rank(kind, moe_starts,
                                                                                          moe_folders):
    """After step 1 every rank's correction bias of every MoE layer it holds is b0 + 1e-3 x sign(mean(c)
    - c), with c counted here by routing the step's whole batch on one card (8 sequences: 2 data ranks,
    4 micro-batches each under ep2 x tp2 x pp2 + SP)."""
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    split, _ = moe_starts["split"]
    model, config = our_model(moe_folders[SPLIT_VERSION] / kind, train=True)
    with paddle.no_grad():
        model(paddle.to_tensor(rows[:, :-1]))
    _, counts, _ = model.run.router_stats.take()
    layers = [layer for layer in model.sublayers() if type(layer).__name__ == "SparseMoE"]
    assert sorted(counts) == [layer.layer_index for layer in layers] and layers
    for layer in layers:
        load = counts[layer.layer_index].numpy().astype(np.float32)
        assert load.sum() == rows.shape[0] * (rows.shape[1] - 1) * config.num_experts_per_tok
        expected = layer.router_layer.correction.numpy() + np.float32(1e-3) * np.sign(load.mean() - load)
        held = [r["folders"][f"{kind}-{SPLIT_VERSION}"]["biases"].get(str(layer.layer_index)) for r in split]
        assert sum(bias is not None for bias in held) == 4  # the ranks of its pipeline stage
        for bias in held:
            if bias is not None:
                np.testing.assert_array_equal(np.float32(bias), expected.astype(np.float32))


@pytest.fixture(scope="module")
def transformers5_checkpoint_logits(moe_starts, tmp_path_factory):
    """transformers 5's logits on IDS of each split start's checkpoint, in transformers' layout as saved
    (one subprocess)."""
    _, out = moe_starts["split"]
    ids = tmp_path_factory.mktemp("moe_ids") / "ids.npy"
    np.save(ids, IDS)
    folders = {f"{kind}-{SPLIT_VERSION}": out / f"{kind}-{SPLIT_VERSION}" / "checkpoint-2"
               for kind in SPLIT_KINDS + FIVE_ONLY_KINDS}
    hf_models.transformers5("logits", ids, *folders.values())
    return {name: np.load(f"{folder}.npy") for name, folder in folders.items()}


def _stored_names(folder) -> set[str]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    names = set()
    for fname in files:
        with safe_open(str(folder / fname), "np") as stored:
            names |= set(stored.keys())
    return names


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_checkpoint_exports_to_both_transformers(kind, moe_starts, moe_folders, tmp_path):
    """One card's checkpoints of both versions' folders, exported: the folder's tensor names (GPT-OSS's
    experts stacked again, DeepSeek's correction biases beside their routers) are the folder's and the
    expert count is under the family's field; transformers 4.55 loads each export with our logits (5.23
    loads the split layout's checkpoints, above)."""
    _, single_out = moe_starts["single"]
    for version in VERSIONS:
        name = f"{kind}-{version}"
        export = export_hf(single_out / name / "checkpoint-2", tmp_path / name)
        written = json.loads((export / "config.json").read_text())
        assert written[EXPERT_COUNT_FIELD[kind]] == config_from_dict(
            open_pretrained(moe_folders[version] / kind).config).num_experts
        assert _stored_names(export) == _stored_names(moe_folders[version] / kind)
        np.testing.assert_allclose(hf_models.logits(export, IDS), our_logits(export, IDS), atol=EXPORT_TOL,
                                   rtol=EXPORT_TOL)


@pytest.mark.multiproc
def test_multi_token_prediction_trains_under_ep2_tp2_pp2_sp_like_single_card(moe_starts, moe_folders):
    """The prediction layer on the last pipeline stage, fed the next tokens' embeddings from the first
    (carried between the stages beside the hidden states), its experts over ep2 and its projection and
    norms sequence-parallel (recomputed in tests/test_moe_runs.py's ep2 x pp2 run): one card's first training loss is transformers 5's next-token
    loss plus MtpModel's, the split layout's evaluation and two training losses are one card's, and so
    are all its weights after them (the prediction layer's and its correction bias among them)."""
    answers = np.load(f"{moe_folders['transformers5'] / MTP_KIND}.mtp.npz")
    (split, split_out), (single, single_out) = moe_starts["split"], moe_starts["single"]
    name = f"{MTP_KIND}-{SPLIT_VERSION}"
    np.testing.assert_allclose(single[0]["folders"][name]["loss"], answers["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(single[0]["folders"][name]["losses"][0], answers["loss"] + answers["mtp_losses"].mean(),
                               rtol=LOSS_RTOL)
    np.testing.assert_allclose(split[0]["folders"][name]["loss"], single[0]["folders"][name]["loss"], rtol=RESUME_RTOL)
    np.testing.assert_allclose(split[0]["folders"][name]["losses"], single[0]["folders"][name]["losses"],
                               rtol=RESUME_RTOL)
    weights = [open_pretrained(out / name / "checkpoint-2") for out in (split_out, single_out)]
    plan = plan_of(config_from_dict(weights[1].config))
    predicting = [tensor for tensor in plan if ".layers.4." in tensor]
    assert "deepseek_v3.layers.4.eh_proj.weight" in predicting and len(predicting) > 30
    for tensor in plan:
        got, reference = weights[0].read(tensor, None, 1, 0), weights[1].read(tensor, None, 1, 0)
        drift = np.linalg.norm(got - reference) / max(np.linalg.norm(reference), 1e-12)
        exact = tensor.endswith("e_score_correction_bias")
        assert drift < (RESUME_RTOL if exact else PARITY_RTOL), f"{tensor}: {drift:.2g}"


@pytest.mark.multiproc
def test_a_checkpoint_with_a_prediction_layer_keeps_it_as_released_folders_do(moe_starts, moe_folders, tmp_path):
    """One card's checkpoint exported, and the split layout's saved in transformers' layout, store the
    tensors the released-style folder stores (the prediction layer's copies of the embedding and head
    included); transformers 5.23 reads each with its model and MtpModel, giving our logits of both."""
    (_, split_out), (_, single_out) = moe_starts["split"], moe_starts["single"]
    name = f"{MTP_KIND}-{SPLIT_VERSION}"
    folders = [export_hf(single_out / name / "checkpoint-2", tmp_path / name), split_out / name / "checkpoint-2"]
    for folder in folders:
        assert _stored_names(folder) == _stored_names(moe_folders["transformers5"] / MTP_KIND)
    hf_models.transformers5("prediction_answers", moe_folders["transformers5"] / "rows.npy",
                            moe_folders["transformers5"] / "ids.npy", *folders)
    for folder in folders:
        answers = np.load(f"{folder}.mtp.npz")
        main, ahead = predictions(folder, IDS)
        np.testing.assert_allclose(main, answers["logits"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
        np.testing.assert_allclose(ahead, answers["predicted"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
