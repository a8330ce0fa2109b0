"""Mixture-of-experts folders as users bring them, on one card: folders saved by transformers 4.55
and 5.23 of every MoE family give transformers' logits; fused-expert folders read as per-expert ones;
the per-layer aux loss is transformers' own balancing statistic of each layer (divided by k) and
exactly the coefficient at uniform routing, its gradient injected at the layer the gradient of the
loss plus the aux losses; a released folder's prediction layer is left unread unless the config
counts it, and read, gives transformers 5's MtpModel logits and loss.

Router weights are random and scaled (`hf_models.ROUTER_SCALE`), and every test checks a margin
between the k-th and (k+1)-th router logit of every token it routes: a near-tie would let a 1e-7
summation difference move a token to another expert.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import numpy as np
import paddle
import pytest
from conftest import IDS
from moe_cases import (
    AUX_RTOL,
    KINDS,
    LOGITS_TOL,
    LOSS_RTOL,
    PREDICTING,
    assert_margins,
    counting_an_absent_prediction_layer,
    our_model,
    predictions,
    routed_margins,
)

from checkpoint.format import CheckpointError
from modeling.deepseek import DeepseekV3Config
from modeling.expert_parallel import expert_order
from modeling.registry import config_from_dict, family_of, plan_of, validate_layout
from modeling.transformers_adapter import ConfigFieldError
from paddle_pp.interop.pretrained import TRANSFORMERS, load_pretrained, open_pretrained
from paddle_pp.planning.memory import plan_layout
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.model_config import ModelSourceError
from paddle_pp.training.trainer import Pretrainer

import hf_models
from parity import our_logits


@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_folder_of_transformers_4_or_5_gives_their_logits(kind, moe_folders):
    for version, root in moe_folders.items():
        assert open_pretrained(root / kind).kind == TRANSFORMERS
        model, config = our_model(root / kind)
        assert_margins(routed_margins(model, IDS))
        np.testing.assert_allclose(our_logits(root / kind, IDS), np.load(root / f"{kind}.npy"), atol=LOGITS_TOL,
                                   rtol=LOGITS_TOL, err_msg=version)
    written5 = json.loads((moe_folders["transformers5"] / "qwen3_moe" / "config.json").read_text())
    assert "num_local_experts" in written5 and "num_experts" not in written5, "5.23 writes qwen3_moe the new way"


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in hf_models.STACKED_ON_DISK]
                         + list(hf_models.RESAVED_FUSED))
def test_a_transformers_5_folder_with_fused_experts_reads_as_its_per_expert_folder(kind, moe_folders):
    """transformers 5.23 re-saving a folder in its in-memory layout (`save_original_format=False`:
    each layer's experts stacked, gate and up fused [E, 2I, H]; Mixtral's block named mlp; Hy3's
    router, correction bias and shared experts under their in-memory names) gives
    every tensor, and each tp2 rank's piece of it, bit for bit as the per-expert folder does, so
    transformers' logits."""
    from safetensors import safe_open

    root = moe_folders["transformers5"]
    fused, per_expert = open_pretrained(root / f"{kind}{hf_models.FUSED}"), open_pretrained(root / kind)
    assert fused.kind == TRANSFORMERS and fused.config == per_expert.config
    config = config_from_dict(fused.config)
    with safe_open(str(fused.folder / "model.safetensors"), "np") as stored:
        shapes = {tuple(stored.get_slice(name).get_shape()) for name in stored.keys()
                  if name.endswith("mlp.experts.gate_up_proj")}
        assert shapes == {(config.num_experts, 2 * getattr(config, config.expert_width), 64)}
    for name, row in plan_of(config).items():
        for parts, part in ((1, 0), (2, 0), (2, 1)):
            axis = row.placement.tp if parts > 1 else None
            np.testing.assert_array_equal(fused.read(name, axis, parts, part), per_expert.read(name, axis, parts, part),
                                          err_msg=f"{name}, piece {part} of {parts}")
    np.testing.assert_allclose(our_logits(fused.folder, IDS), np.load(root / f"{kind}.npy"), atol=LOGITS_TOL,
                               rtol=LOGITS_TOL)


def _transformers_layer_aux(folder, ids: np.ndarray, top_k: int) -> list[float]:
    """transformers' own balancing statistic (`load_balancing_loss_func`) of each MoE layer alone."""
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    logits = []  # each router's output, read where it is computed (Qwen2-MoE's own aux path fails on CPU in 4.55)
    for name, module in model.named_modules():
        if name.endswith(".gate"):
            module.register_forward_hook(lambda _module, _inputs, output: logits.append(output))
    with torch.no_grad():
        model(torch.tensor(ids))
    return [float(load_balancing_loss_func((layer,), layer.shape[-1], top_k)) for layer in logits]


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_the_aux_loss_of_each_layer_is_transformers_statistic_over_k_times_the_coefficient(kind, moe_folders):
    """transformers pools every layer into one E * sum f P whose balanced value is k; ours is per
    layer with balanced value 1: each of our layers' aux loss is transformers' statistic of that
    layer alone, divided by k, times router_aux_loss_coef."""
    folder = moe_folders["transformers4"] / kind
    model, config = our_model(folder, train=True)
    model.run.router_stats.take()
    model(paddle.to_tensor(IDS))
    aux, _, _ = model.run.router_stats.take()
    ours = [float(values[0]) for _, values in sorted(aux.items())]
    theirs = _transformers_layer_aux(folder, IDS, config.num_experts_per_tok)
    assert len(ours) == len(theirs) == sum(1 for i in range(config.num_hidden_layers)
                                           if i not in (config.mlp_only_layers or ()))
    np.testing.assert_allclose(ours, np.array(theirs) / config.num_experts_per_tok * config.router_aux_loss_coef,
                               rtol=AUX_RTOL)


def test_the_aux_loss_is_the_coefficient_at_uniform_routing_and_its_gradient_is_the_aux_losses(moe_folders):
    """Router weights zero: every probability 1/E, so each layer's aux loss is 1 x the coefficient.
    With random routers, the router gradient the layer injects equals autograd's gradient of the
    loss plus the recorded aux losses (computed again from the same probabilities)."""
    folder = moe_folders["transformers4"] / "qwen3_moe"
    model, config = our_model(folder, train=True)
    ids = paddle.to_tensor(IDS)
    routers = [layer for layer in model.sublayers() if type(layer).__name__ == "SparseMoE"]
    routing = routers[0].declared.routing
    assert routing.aux_coef == config.router_aux_loss_coef > 0
    saved = [router.router_layer.weight.numpy() for router in routers]
    for router in routers:
        router.router_layer.weight.set_value(np.zeros_like(router.router_layer.weight.numpy()))
    model.run.router_stats.take()
    model(ids)
    aux, _, _ = model.run.router_stats.take()
    np.testing.assert_allclose([float(v[0]) for v in aux.values()], routing.aux_coef, rtol=1e-6)

    for router, weight in zip(routers, saved):
        router.router_layer.weight.set_value(weight)
    labels = paddle.to_tensor(np.roll(IDS, -1, axis=1))
    loss, _ = model(ids, labels)
    loss.backward()
    injected = [router.router_layer.weight.grad.numpy().copy() for router in routers]
    model.clear_gradients()
    recorded = []
    for router in routers:
        route = router.route

        def keep(flat, route=route):
            probs, chosen, weights = route(flat)
            recorded.append((probs, chosen))
            return probs, chosen, weights
        router.route = keep
        router.declared = replace(router.declared, routing=replace(routing, aux_coef=0.0))
    loss, _ = model(ids, labels)
    total = loss + sum(routing.aux_loss(probs, paddle.bincount(chosen.flatten(), minlength=config.num_experts),
                                        IDS.shape[0], chosen) * routing.aux_coef for probs, chosen in recorded)
    total.backward()
    for ours, reference in zip(injected, [router.router_layer.weight.grad.numpy() for router in routers]):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-9)


def test_deepseek_v2s_seq_aux_counts_the_routed_experts_per_sequence():
    """DeepSeek-V2's balance loss as its own modeling code computes it (transformers has none): with
    `seq_aux` (its default), per sequence, f_i = count of expert i among the routed choices x E / (T x k),
    times the sequence's mean score, summed over experts, averaged over sequences, times aux_loss_alpha;
    without it, the Switch form over the micro-batch. Routed choices under group_limited_greedy differ
    from the top-k of the scores here, so counting the wrong ones would show."""
    fields = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, topk_method="group_limited_greedy", n_group=4, topk_group=1)
    rng = np.random.default_rng(0)
    logits = paddle.to_tensor(rng.normal(size=(2 * 6, 8)).astype("float32"))
    for seq_aux in (True, False):
        routing = config_from_dict(dict(model_type="deepseek_v2", seq_aux=seq_aux, **fields)).routing()
        scores, chosen, _ = routing.route(logits, None)
        assert (np.sort(chosen.numpy()) != np.sort(np.argsort(-scores.numpy())[:, :2])).any()  # groups bind
        counts = paddle.bincount(chosen.flatten(), minlength=8)
        ours = float(routing.aux_loss(scores, counts, 2, chosen)) * routing.aux_coef
        probs, picks = scores.numpy().reshape(2, 6, 8), chosen.numpy().reshape(2, 12)
        if seq_aux:
            share = np.stack([np.bincount(row, minlength=8) for row in picks]) / (6 * 2 / 8)
            expected = (share * probs.mean(axis=1)).sum(axis=1).mean() * 0.001
        else:
            expected = (np.bincount(picks.ravel(), minlength=8) / 24 * 8 * probs.reshape(12, 8).mean(0)).sum() * 0.001
        np.testing.assert_allclose(ours, expected, rtol=1e-6)
    v3 = {**fields, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "seq_aux": False}
    with pytest.raises(ConfigFieldError, match=re.escape("seq_aux=False (changes the model")):
        family_of(config_from_dict({**v3, "seq_aux": True})).transformers.our_config(v3, DeepseekV3Config)


def _with_a_layer_past_the_last(source, target) -> int:
    """`source` (a transformers folder) copied with one more decoder layer's tensors on disk, shaped as
    DeepSeek-V3's released layer 61 (its last layer's, plus the MTP block's enorm, hnorm, eh_proj and
    shared_head.norm); the index of that layer."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    last = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(target / "model.safetensors"))
    for name in [n for n in tensors if n.startswith(f"model.layers.{last - 1}.")]:
        tensors[name.replace(f"layers.{last - 1}.", f"layers.{last}.", 1)] = tensors[name]
    hidden = tensors["model.norm.weight"].shape[0]
    for part, shape in {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                        "shared_head.norm.weight": (hidden,)}.items():
        tensors[f"model.layers.{last}.{part}"] = np.ones(shape, np.float32)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return last


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_a_released_folders_mtp_layer_is_left_unread_when_the_config_does_not_count_it(kind, moe_folders, tmp_path):
    """A folder's MTP layer (DeepSeek-V3's layer 61) that its config does not count (num_nextn_predict_layers
    0, to train the main model alone) is left unread, as transformers leaves it, with a note: the model
    gives the logits of the folder without it; counted, it is read as the prediction layer. Another
    family's extra layer is refused."""
    source = moe_folders["transformers4"] / kind
    folder = tmp_path / kind
    mtp = _with_a_layer_past_the_last(source, folder)
    opened = open_pretrained(folder)
    assert len(opened.notes) == 1 and f"layers {mtp} left unread: multi-token prediction" in opened.notes[0]
    np.testing.assert_array_equal(our_logits(folder, IDS), our_logits(source, IDS))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    counted = open_pretrained(folder)
    assert counted.notes == () and f"{kind}.layers.{mtp}.eh_proj.weight" in plan_of(config_from_dict(counted.config))
    other = tmp_path / "qwen3_moe"
    extra = _with_a_layer_past_the_last(moe_folders["transformers4"] / "qwen3_moe", other)
    with pytest.raises(CheckpointError, match=f"model.layers.{extra}.enorm.weight: not a tensor of"):
        open_pretrained(other)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_a_folder_counting_a_prediction_layer_it_does_not_hold_opens_without_it_or_starts_it_fresh(
        kind, moe_folders, tmp_path, monkeypatch):
    """Such a folder opens (and opens for a resume, weights unread) without the layer, as transformers
    reads it, with a note naming --fresh_prediction_layers, and gives transformers' logits; with the
    flag it opens with the layer, which loading leaves as the model initialised it while every other
    tensor is read (the logits, which the layer does not reach in evaluation, are transformers');
    tests/test_moe_runs.py trains one. The flag on a folder with no layer to start fresh is refused by
    name before any process group."""
    root = moe_folders["transformers5"]
    folder = counting_an_absent_prediction_layer(root / kind, tmp_path / kind)
    theirs = np.load(root / f"{kind}.npy")
    for weights in (True, False):
        opened = open_pretrained(folder, weights=weights)
        assert config_from_dict(opened.config).mtp_depth == 0 and opened.fresh == ()
        assert "counts 1 multi-token prediction layer" in opened.notes[0] and "--fresh_prediction_layers" in opened.notes[0]
    np.testing.assert_allclose(our_logits(folder, IDS), theirs, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    fresh = open_pretrained(folder, fresh_prediction_layers=True)
    ours = config_from_dict(fresh.config)
    assert ours.mtp_depth == 1 and f"{kind}.layers.{ours.num_hidden_layers}.eh_proj.weight" in fresh.fresh
    model = family_of(ours).causal_lm(ours)
    initial = {name: param.numpy().copy() for name, param in model.state_dict().items()}
    load_pretrained(fresh, model, plan_of(ours).axes(), None)
    loaded = model.state_dict()
    assert all(np.array_equal(loaded[name].numpy(), initial[name]) for name in fresh.fresh)
    model.eval()
    with paddle.no_grad():
        np.testing.assert_allclose(model(paddle.to_tensor(IDS)).numpy(), theirs, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    with pytest.raises(ModelSourceError, match="--fresh_prediction_layers: .* has no multi-token prediction layers"):
        Pretrainer(parse_args(["--model_name_or_path", str(root / kind), "--fresh_prediction_layers",
                               "--output_dir", str(tmp_path / "out")]))  # its config counts none


def test_a_hybrid_folders_mtp_layer_is_left_unread_as_transformers_leaves_it(moe_folders, tmp_path):
    """Released Qwen3.5 / Qwen3-Next folders carry their multi-token prediction layer under `mtp.*` (sized
    by `mtp_num_hidden_layers`), which transformers' models leave unread: so do we, with a note, and
    the folder gives its logits without it; a tensor under no such prefix is still refused."""
    from safetensors.numpy import load_file, save_file

    source, folder = moe_folders["transformers5"] / "qwen3_next", tmp_path / "qwen3_next"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    tensors = load_file(str(folder / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    tensors |= {"mtp.fc.weight": np.ones((hidden, 2 * hidden), np.float32), "mtp.norm.weight": np.ones(hidden, np.float32)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    opened = open_pretrained(folder)
    assert len(opened.notes) == 1 and "2 tensors under mtp. left unread" in opened.notes[0]
    np.testing.assert_array_equal(our_logits(folder, IDS), our_logits(source, IDS))
    save_file({**tensors, "mtpx.weight": np.ones(hidden, np.float32)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="mtpx.weight: not a tensor of"):
        open_pretrained(folder)


def test_a_kimi_linear_config_counting_prediction_layers_is_refused_by_name(moe_folders, tmp_path):
    """Kimi Linear has no multi-token prediction layers (transformers builds none): a config counting one
    is refused, naming the field, not built into a layer its pattern does not cover."""
    source, folder = moe_folders["transformers5"] / "kimi_linear", tmp_path / "kimi_linear"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=1: Kimi Linear has no multi-token"):
        open_pretrained(folder)


def test_received_rows_are_regrouped_by_expert_then_source():
    """Rank-local expert order of the rows an expert-parallel rank received: source 0 sent 1 row for
    expert 0 and 2 for expert 1, source 1 sent 3 for expert 0 and none for expert 1."""
    assert expert_order(np.array([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_order(np.zeros([2, 2], np.int64)).tolist() == []


@pytest.mark.parametrize("kind", list(PREDICTING))
def test_a_multi_token_prediction_layer_gives_transformers_5s_mtp_model_logits_and_loss(kind, moe_folders):
    """A DeepSeek-V3 folder with one prediction layer and a GLM-4.5 folder with two, stored as released
    (transformers 5.23's MtpModel made them and reads them back): our next-token logits are transformers'
    model's and each prediction layer's are MtpModel's (the embeddings of the tokens k further and the
    previous depth's output, the main model's final hidden states at depth 1, through enorm/hnorm,
    eh_proj, an MoE decoder layer with a correction bias (latent attention, or GLM's grouped-query
    attention with biases and partial rotary) and shared_head's norm, then the model's head), at every
    position; the training loss is transformers' next-token loss plus num_nextn_predict_lambda times
    the mean of MtpModel's depth losses (each on the tokens k + 1 further), the evaluation loss
    the next-token loss alone; the planner counts the layer's parameters. Context parallelism is
    refused by name."""
    folder = moe_folders["transformers5"] / kind
    answers = np.load(f"{folder}.mtp.npz")
    main, ahead = predictions(folder, IDS)
    np.testing.assert_allclose(main, answers["logits"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
    np.testing.assert_allclose(ahead, answers["predicted"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
    assert np.abs(ahead - main).max() > 0.1, "the prediction layer's logits are not the next token's"
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    inputs, labels = paddle.to_tensor(rows[:, :-1]), paddle.to_tensor(rows[:, 1:])
    model, config = our_model(folder, train=True)
    with paddle.no_grad():
        for weight in (1.0, 0.3):
            model.criterion.mtp_weight = weight  # lambda / D: each depth's weight
            np.testing.assert_allclose(float(model.criterion(model(inputs), labels)),
                                       answers["loss"] + weight * answers["mtp_losses"].sum(), rtol=LOSS_RTOL)
        model.eval()
        np.testing.assert_allclose(float(model.criterion(model(inputs), labels)), answers["loss"], rtol=LOSS_RTOL)
    assert config.mtp_loss_weight == 1.0 / PREDICTING[kind][1]  # PaddleNLP's default lambda: the config is silent
    assert plan_layout(config, Layout(world_size=1))[0].parameters == sum(
        int(np.prod(param.shape)) for param in model.parameters())  # the planner counts the prediction layer
    validate_layout(config, Layout(world_size=2, context_parallel_degree=2))  # trained under cp: test_documents.py


