"""Mixture-of-experts families as users bring them: folders saved by transformers 4.55 and 5.23 of
every MoE family give transformers' logits and, exported, load back into both; the per-layer aux
loss is transformers' own balancing statistic of each layer (divided by k) and exactly the
coefficient at uniform routing; its gradient injected at the layer is the gradient of the loss plus
the aux losses; every family starts under ep2 x dp2 x tp2 x pp2 + SP at transformers 5's loss; a
DeepSeek-V3-shaped model trains like single card under dp2 x tp2 x pp2 + SP x ep2, dp2 x sharding2
stage1 with ep2 and with ep4 (experts across the sharding ranks), cp2 x sharding2 stage1 x ep2, and stage2
without ep; its ep2 checkpoint resumes under ep4 across the sharding ranks and on one card, and
after a kill mid-save on one card (real processes, fp32).

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
from conftest import FOLDER_STEPS, IDS, first_batch

from checkpoint.format import CheckpointError, tokenizer_files
from checkpoint.verify import verify_checkpoint
from modeling.deepseek import DeepseekV3Config
from modeling.expert_parallel import expert_order
from modeling.registry import config_from_dict, family_of, plan_of, plan_of_folder, validate_layout
from modeling.transformers_adapter import ConfigFieldError
from paddle_pp.interop.pretrained import TRANSFORMERS, load_pretrained, open_pretrained
from paddle_pp.interop.transformers import export_hf
from paddle_pp.planning.memory import plan_layout
from paddle_pp.runtime.launch import LaunchError, launch
from paddle_pp.runtime.layout import Layout

import hf_models
from parity import our_logits
from runs import (
    MICRO1,
    MODEL,
    PP2,
    RESUME_STEP,
    TOKENIZER,
    TP2,
    TRAINER,
    Run,
    assert_trains_like,
    history,
    planned_writers,
    written_by_rank,
)

LOGITS_TOL = 1e-5  # fp32, the same weights and routing (measured: at most 4.2e-7)
EXPORT_TOL = 1e-4
LOSS_RTOL = 1e-5
PARITY_RTOL = 1e-4
RESUME_RTOL = 1e-5
AUX_RTOL = 1e-5
MARGIN = 1e-4  # least gap between the k-th and (k+1)-th router logit of a routed token (layouts differ by ~1e-6)
ROUTING_NOISE = 1e-6  # how far apart two layouts' router scores come over 20 steps (their summation orders)
KINDS = list(hf_models.MOE_KINDS)
MTP_KIND = "deepseek_v3_mtp"  # transformers 5's DeepSeek-V3 folder given a multi-token prediction layer
# such folders: from which kind's, with how many prediction layers (GLM's two chained, as transformers chains them)
PREDICTING = {MTP_KIND: ("deepseek_v3", 1), "glm4_moe_mtp": ("glm4_moe", 2)}


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory, data_cache) -> dict:
    """Each MoE kind saved by transformers 4.55 (this venv's) and 5.23 (one subprocess), with that
    version's logits on IDS and loss on the first batch of a FOLDER_STEPS run beside it."""
    rows = first_batch(data_cache, TOKENIZER, FOLDER_STEPS)
    roots = {version: tmp_path_factory.mktemp(f"moe_{version}") for version in ("transformers4", "transformers5")}
    hf_models.make_with_answers(roots["transformers4"], rows, IDS, KINDS)
    np.save(roots["transformers5"] / "rows.npy", rows)
    np.save(roots["transformers5"] / "ids.npy", IDS)
    hf_models.transformers5("make", roots["transformers5"], roots["transformers5"] / "rows.npy",
                            roots["transformers5"] / "ids.npy", *KINDS)
    for root in roots.values():
        for kind in KINDS:
            for path in tokenizer_files(TOKENIZER):
                shutil.copy(path, root / kind)
    for predicting, (kind, depth) in PREDICTING.items():
        shutil.copytree(roots["transformers5"] / kind, roots["transformers5"] / predicting)
        hf_models.transformers5("with_prediction_layers", roots["transformers5"] / predicting, depth,
                                roots["transformers5"] / "rows.npy", roots["transformers5"] / "ids.npy")
    return roots


def _our_model(folder, train: bool = False):
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    model.train() if train else model.eval()
    return model, config


def _routed(model, ids: np.ndarray) -> list[float]:
    """Each MoE layer's least routing margin on `ids` (`Routing.margin`: the gap between a token's k-th
    and (k+1)-th choice, and between the last kept and the next group), as the model routed them."""
    margins = []
    for layer in model.sublayers():
        if type(layer).__name__ == "SparseMoE":
            route = layer.route

            def recorded(flat, layer=layer, route=route):
                out = route(flat)
                margins.append(float(layer.declared.routing.margin(out[0], layer.router_layer.correction)))
                return out

            layer.route = recorded
    with paddle.no_grad():
        model(paddle.to_tensor(ids))
    return margins


def _assert_margins(margins: list[float]) -> None:
    assert min(margins) > MARGIN, f"a token sits {min(margins):.2g} from a routing tie: reseed the test folders"


@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_folder_of_transformers_4_or_5_gives_their_logits(kind, moe_folders):
    for version, root in moe_folders.items():
        assert open_pretrained(root / kind).kind == TRANSFORMERS
        model, config = _our_model(root / kind)
        _assert_margins(_routed(model, IDS))
        np.testing.assert_allclose(our_logits(root / kind, IDS), np.load(root / f"{kind}.npy"), atol=LOGITS_TOL,
                                   rtol=LOGITS_TOL, err_msg=version)
    written5 = json.loads((moe_folders["transformers5"] / "qwen3_moe" / "config.json").read_text())
    assert "num_local_experts" in written5 and "num_experts" not in written5, "5.23 writes qwen3_moe the new way"


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in hf_models.STACKED_ON_DISK])
def test_a_transformers_5_folder_with_fused_experts_reads_as_its_per_expert_folder(kind, moe_folders):
    """transformers 5.23 re-saving a folder in its in-memory layout (`save_original_format=False`:
    each layer's experts stacked, gate and up fused [E, 2I, H]; Mixtral's block named mlp) gives
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
    model, config = _our_model(folder, train=True)
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
    model, config = _our_model(folder, train=True)
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


def test_received_rows_are_regrouped_by_expert_then_source():
    """Rank-local expert order of the rows an expert-parallel rank received: source 0 sent 1 row for
    expert 0 and 2 for expert 1, source 1 sent 3 for expert 0 and none for expert 1."""
    assert expert_order(np.array([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_order(np.zeros([2, 2], np.int64)).tolist() == []


def _start(kind: str, root) -> tuple[str, ...]:
    return ("--model_name_or_path", str(root / kind))


EP2, EP4 = ("--expert_parallel_degree", "2"), ("--expert_parallel_degree", "4")
DP2_TP2_PP2_SP = TP2 + PP2 + ("--sequence_parallel",)  # on 8 ranks: dp 2


DEEPSEEK = ("--num_key_value_heads", "4")  # MLA's kv heads are its heads (the runs' MODEL flags say 2)


@pytest.fixture(scope="module")
def moe_runs(moe_folders):
    """A DeepSeek-V3-shaped model (latent attention with yarn, a dense first layer, then 8 experts in 2
    groups with sigmoid routing, correction biases and a shared expert; a multi-token prediction
    layer) from its transformers 5 folder: 20 steps on one card; under dp2 x tp2 x pp2 + SP with its experts over ep2, recomputing
    whole layers (saving at step 10); under dp2 x sharding2 stage1 over ep2 with full recompute, and
    over ep4 (the expert group across the sharding ranks, each rank updating its own experts outside
    stage1's partition); under cp2 x sharding2 stage1 over ep2 (each expert's states on one of its
    two replicas, the cp peers); under dp2 x sharding2 stage2 without ep; and the ep2
    step-10 checkpoint resumed under ep4 across the sharding ranks (two experts per rank) and on one card."""
    start = _start(MTP_KIND, moe_folders["transformers5"]) + DEEPSEEK
    single = Run("deepseek_single", 1, start + ("--save_steps", "20"))
    hybrid = Run("deepseek_ep2_tp2_pp2_sp", 8, start + DP2_TP2_PP2_SP + EP2 + (
        "--recompute", "--save_steps", str(RESUME_STEP)))
    return {"single": single, "ep2_tp2_pp2_sp": hybrid,
            "ep2_stage1": Run("deepseek_ep2_stage1", 4, start + EP2 + MICRO1 + (
                "--sharding_parallel_degree", "2", "--sharding", "stage1", "--recompute", "--save_steps", "20")),
            "ep4_stage1": Run("deepseek_ep4_stage1", 4, start + EP4 + MICRO1 + (
                "--sharding_parallel_degree", "2", "--sharding", "stage1", "--save_steps", "20")),
            "ep2_cp2_stage1": Run("deepseek_ep2_cp2_stage1", 4, start + EP2 + (
                "--context_parallel_degree", "2", "--sharding_parallel_degree", "2", "--sharding", "stage1",
                "--save_steps", "20")),
            "stage2": Run("deepseek_dp2_stage2", 4, start + MICRO1 + ("--sharding_parallel_degree", "2", "--sharding",
                                                             "stage2", "--recompute", "--save_steps", "20")),
            "resumed_ep4": Run("deepseek_resumed_ep4_stage1", 4, start + EP4 + (
                "--sharding_parallel_degree", "2", "--sharding", "stage1"), resume_from=hybrid),
            "resumed_single": Run("deepseek_resumed_single", 1, start, resume_from=hybrid)}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["ep2_tp2_pp2_sp", "ep2_stage1", "ep4_stage1", "ep2_cp2_stage1", "stage2"])
def test_a_deepseek_v3_shaped_model_trains_like_single_card(layout, moe_runs, pretrain_run, moe_folders):
    """Losses, evaluation, grad norms, aux losses, multi-token prediction losses and final weights (the
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
        np.testing.assert_allclose(history(pretrain_run, moe_runs[layout])[metric], single[metric], rtol=PARITY_RTOL)
    assert single["losses"][-1] < single["losses"][0] - 0.5, "the model learns"


@pytest.mark.multiproc
@pytest.mark.parametrize("resumed", ["resumed_ep4", "resumed_single"])
def test_a_deepseek_checkpoint_resumes_across_expert_parallel_sizes_on_the_single_card_curve(resumed, moe_runs,
                                                                                              pretrain_run):
    """The ep2 checkpoint (each expert written by one of the ranks holding it, the correction biases
    beside their routers, all under single-card names) gives every rank of ep4, and one card, exactly
    its weights, biases and Adam states before the first step, and the run continues on the
    uninterrupted single-card curve."""
    results, _ = pretrain_run(moe_runs[resumed])
    assert [r["resumed_exactly"] for r in results] == [True] * len(results)
    single = history(pretrain_run, moe_runs["single"])
    np.testing.assert_allclose(history(pretrain_run, moe_runs[resumed])["losses"], single["losses"][RESUME_STEP:],
                               rtol=RESUME_RTOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, step", [("ep2_tp2_pp2_sp", RESUME_STEP), ("ep4_stage1", 20), ("ep2_cp2_stage1", 20)])
def test_an_expert_parallel_save_is_written_by_every_rank_as_the_planner_predicts(layout, step, moe_runs,
                                                                                 pretrain_run):
    """Each expert's tensors come from one of the ranks holding it (the planner's writer for each;
    with experts across sharding ranks, its AdamW states from the replica updating it, outside
    stage1's partition, the cp peers among the replicas), every rank writes a share, and the
    checkpoint verifies."""
    run = moe_runs[layout]
    _, out = pretrain_run(run)
    folder = out / f"checkpoint-{step}"
    written, writer = written_by_rank(folder)
    assert sorted(written) == list(range(run.nproc))
    assert writer == planned_writers(folder, run.flags, run.nproc)
    assert verify_checkpoint(folder, plan_of_folder) == []


@pytest.mark.multiproc
def test_a_kill_during_an_expert_parallel_save_leaves_the_last_checkpoint_resumable(moe_runs, moe_folders, pretrain_run,
                                                                                     data_cache, tmp_path):
    """Four ranks (dp4: each expert on 2 of them, so their gradients are summed over the replicas)
    train 2 steps on the single-card curve, then die while writing the step-4 save; checkpoint-2
    resumes on one card with exactly its weights and Adam states and continues on the curve."""
    out = tmp_path / "out"
    common = [*MODEL, *_start(MTP_KIND, moe_folders["transformers5"]), *DEEPSEEK, "--save_steps", "2",
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


@pytest.fixture(scope="module")
def switch_runs(moe_folders):
    """Qwen2-MoE (softmax router with the Switch aux loss, a gated shared expert, a dense layer) from
    its transformers 5 folder, one row per micro-batch: 20 steps on one card and under cp2 x dp2 x ep2."""
    start = _start("qwen2_moe", moe_folders["transformers5"]) + MICRO1 + ("--save_steps", "20")
    return {"single": Run("qwen2_moe_single", 1, start),
            "cp2_ep2": Run("qwen2_moe_cp2_ep2", 4, start + EP2 + ("--context_parallel_degree", "2"))}


@pytest.mark.multiproc
def test_a_switch_routed_model_trains_like_single_card_with_its_sequences_cut_over_cp(switch_runs, pretrain_run):
    """The Switch aux loss is a statistic of the whole micro-batch: under cp each rank routes half of
    every sequence and the counts and mean scores are pooled over the ring before the product, so
    the aux losses, losses, grad norms and final weights are one card's (1e-4), experts over ep2."""
    single = history(pretrain_run, switch_runs["single"])
    assert min(single["router_margins"]) > ROUTING_NOISE, "a token came within summation noise of a routing tie"
    assert min(single["aux_losses"]) > 0
    np.testing.assert_allclose(history(pretrain_run, switch_runs["cp2_ep2"])["aux_losses"], single["aux_losses"],
                               rtol=PARITY_RTOL)
    assert_trains_like(pretrain_run, switch_runs["cp2_ep2"], switch_runs["single"], PARITY_RTOL)


EXPERT_COUNT_FIELD = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts", "mixtral": "num_local_experts",
                      "olmoe": "num_experts", "deepseek_v3": "n_routed_experts", "deepseek_v2": "n_routed_experts",
                      "glm4_moe": "n_routed_experts", "gpt_oss": "num_local_experts", "ernie4_5_moe": "moe_num_experts"}
VERSIONS = ("transformers4", "transformers5")
SPLIT_VERSION = "transformers5"  # the folders the split layout starts


@pytest.fixture(scope="module")
def moe_starts(moe_folders, run_workers_module, tmp_path_factory):
    """Every MoE kind started in one launch per layout (`workers/folders_worker.py`): from transformers
    5's folders under ep2 x dp2 x tp2 x pp2 + SP recomputing whole layers (8 ranks; its checkpoints
    saved in transformers' layout), from both versions' on one card, both with one row per micro-batch
    (the Switch aux loss is a micro-batch's statistic). A 4.x folder differs from a 5 one in its
    config's spelling and its weights, both read before any layout is applied: its start under the
    split layout would run the 5 folder's code paths again (and cost 7 s a folder on 8 ranks here).
    Per layout: (the results by folder name `<kind>-<version>`, the folder of their checkpoints)."""
    links = tmp_path_factory.mktemp("moe_starts")
    folders = {version: [] for version in VERSIONS}
    for kind, version in [(kind, version) for kind in KINDS for version in VERSIONS] + [(MTP_KIND, SPLIT_VERSION)]:
        (links / f"{kind}-{version}").symlink_to(moe_folders[version] / kind)
        folders[version].append(links / f"{kind}-{version}")
    rows = moe_folders["transformers5"] / "rows.npy"
    started = {}
    for name, nproc, started_folders, layout in (
            ("split", 8, folders[SPLIT_VERSION], (*EP2, *DP2_TP2_PP2_SP, "--recompute", "--save_to_hf")),
            ("single", 1, [folder for version in VERSIONS for folder in folders[version]], ())):
        results = run_workers_module("folders_worker.py", nproc, [rows, links / name, 8, *started_folders, *layout,
                                                                  "--micro_batch_size", 1],
                                     timeout=900, tag=f"moe_starts_{name}")
        assert len({json.dumps({k: v["losses"] for k, v in r["folders"].items()}) for r in results}) == 1
        started[name] = (results, links / name)
    return started


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_folder_starts_under_ep2_tp2_pp2_sp_at_its_loss_and_trains_like_single_card(kind, moe_starts,
                                                                                          moe_folders):
    """Both versions' folders of every family (Qwen3-MoE's per-head q/k norms, OLMoE's split over tp,
    DeepSeek-V3's latent attention with sigmoid group-limited routing and correction biases that change
    the choice, V2's greedy groups, GLM-4.5's, GPT-OSS's sinks and stacked experts) start on one card
    at the loss of the transformers that saved them; transformers 5's start under ep2 x dp2 x tp2 x pp2
    + SP, recomputing whole layers, at that loss, and their two steps and the checkpoint's weights are
    one card's (every q/k norm and correction bias to 1e-5; other weights to 1e-4: Adam's first steps
    turn near-zero gradients' summation noise into lr-sized moves)."""
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    (split, split_out), (single, single_out) = moe_starts["split"], moe_starts["single"]
    expected = {"transformers5": json.loads((moe_folders["transformers5"] / f"{kind}.json").read_text())["loss"],
                "transformers4": hf_models.loss(moe_folders["transformers4"] / kind, rows)}
    for version in VERSIONS:
        np.testing.assert_allclose(single[0]["folders"][f"{kind}-{version}"]["loss"], expected[version],
                                   rtol=LOSS_RTOL, err_msg=version)
    name = f"{kind}-{SPLIT_VERSION}"
    np.testing.assert_allclose(split[0]["folders"][name]["loss"], expected[SPLIT_VERSION], rtol=LOSS_RTOL)
    np.testing.assert_allclose(split[0]["folders"][name]["losses"], single[0]["folders"][name]["losses"],
                               rtol=RESUME_RTOL)
    weights = [open_pretrained(out / name / "checkpoint-2") for out in (split_out, single_out)]
    for tensor in plan_of(config_from_dict(weights[1].config)):  # the split one's in transformers' layout
        got, reference = weights[0].read(tensor, None, 1, 0), weights[1].read(tensor, None, 1, 0)
        drift = np.linalg.norm(got - reference) / max(np.linalg.norm(reference), 1e-12)
        exact = tensor.endswith(("q_norm.weight", "k_norm.weight", "e_score_correction_bias"))
        assert drift < (RESUME_RTOL if exact else PARITY_RTOL), f"{name} {tensor}: {drift:.2g}"


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "ernie4_5_moe", MTP_KIND])
def test_the_correction_bias_moves_by_the_rule_from_the_steps_global_counts_on_every_rank(kind, moe_starts,
                                                                                          moe_folders):
    """After step 1 every rank's correction bias of every MoE layer it holds is b0 + 1e-3 x sign(mean(c)
    - c), with c counted here by routing the step's whole batch on one card (8 sequences: 2 data ranks,
    4 micro-batches each under ep2 x tp2 x pp2 + SP, every layer recomputed, so counted once)."""
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    split, _ = moe_starts["split"]
    model, config = _our_model(moe_folders[SPLIT_VERSION] / kind, train=True)
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
    folders = {f"{kind}-{SPLIT_VERSION}": out / f"{kind}-{SPLIT_VERSION}" / "checkpoint-2" for kind in KINDS}
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
def test_an_moe_checkpoint_loads_in_both_transformers_as_saved_and_exported(kind, moe_starts, moe_folders,
                                                                            transformers5_checkpoint_logits, tmp_path):
    """The split start's checkpoint (of transformers 5's folder), saved in transformers' layout, and the
    single card's of both versions' folders, exported: the folder's tensor names (GPT-OSS's experts
    stacked again, DeepSeek's correction biases beside their routers) and config.json are the same in
    all and the expert count is under the family's field; transformers 5.23 loads the checkpoint as it
    is and 4.55 the exports, each with our logits."""
    (_, out), (_, single_out) = moe_starts["split"], moe_starts["single"]
    for version in VERSIONS:
        name = f"{kind}-{version}"
        export = export_hf(single_out / name / "checkpoint-2", tmp_path / name)
        written = json.loads((export / "config.json").read_text())
        assert written[EXPERT_COUNT_FIELD[kind]] == config_from_dict(
            open_pretrained(moe_folders[version] / kind).config).num_experts
        assert _stored_names(export) == _stored_names(moe_folders[version] / kind)
        np.testing.assert_allclose(hf_models.logits(export, IDS), our_logits(export, IDS), atol=EXPORT_TOL,
                                   rtol=EXPORT_TOL)
        if version == SPLIT_VERSION:
            checkpoint = out / name / "checkpoint-2"
            assert json.loads((checkpoint / "config.json").read_text()) == written
            assert _stored_names(checkpoint) == _stored_names(export)
            np.testing.assert_allclose(transformers5_checkpoint_logits[name], our_logits(checkpoint, IDS),
                                       atol=EXPORT_TOL, rtol=EXPORT_TOL)


def _predictions(folder, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our (next-token logits, each prediction layer's logits [depth, ...]) of `ids` from `folder`
    (training mode: the prediction layers run in training only)."""
    model, _ = _our_model(folder, train=True)
    with paddle.no_grad():
        main, *depths = model(paddle.to_tensor(ids))
    return main.numpy(), np.stack([depth.numpy() for depth in depths])


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
    main, ahead = _predictions(folder, IDS)
    np.testing.assert_allclose(main, answers["logits"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
    np.testing.assert_allclose(ahead, answers["predicted"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
    assert np.abs(ahead - main).max() > 0.1, "the prediction layer's logits are not the next token's"
    rows = np.load(moe_folders["transformers5"] / "rows.npy")
    inputs, labels = paddle.to_tensor(rows[:, :-1]), paddle.to_tensor(rows[:, 1:])
    model, config = _our_model(folder, train=True)
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


@pytest.mark.multiproc
def test_multi_token_prediction_trains_under_ep2_tp2_pp2_sp_like_single_card(moe_starts, moe_folders):
    """The prediction layer on the last pipeline stage, fed the next tokens' embeddings from the first
    (carried between the stages beside the hidden states), its experts over ep2 and its projection and
    norms sequence-parallel, recomputed: one card's first training loss is transformers 5's next-token
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
        main, ahead = _predictions(folder, IDS)
        np.testing.assert_allclose(main, answers["logits"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
        np.testing.assert_allclose(ahead, answers["predicted"], rtol=LOGITS_TOL, atol=LOGITS_TOL)
