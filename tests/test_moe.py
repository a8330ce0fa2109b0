"""Mixture-of-experts families as users bring them: folders saved by transformers 4.55 and 5.23
(Qwen3-MoE written the transformers-5 way, Qwen2-MoE with a shared expert and a dense layer,
Mixtral, OLMoE) give transformers' logits and, exported, load back into both; the per-layer aux
loss is transformers' own balancing statistic of each layer (divided by k) and exactly the
coefficient at uniform routing; its gradient injected at the layer is the gradient of the loss plus
the aux losses; Qwen2-MoE trains like single card with its experts split over ep2 under dp2 x tp2 x
pp2 + SP and dp2 x sharding2 stage1 (with recompute), and under dp2 x sharding2 stage2 without ep;
its ep2 checkpoint resumes under ep4 and, after a kill mid-save, on one card; the other families
start under ep2 x tp2 x pp2 at transformers 5's loss (real processes, fp32).

Router weights are random and scaled (`hf_models.ROUTER_SCALE`), and every test checks a margin
between the k-th and (k+1)-th router logit of every token it routes: a near-tie would let a 1e-7
summation difference move a token to another expert.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import paddle
import pytest
from conftest import FOLDER_STEPS, IDS, first_batch

from checkpoint.format import tokenizer_files
from checkpoint.verify import verify_checkpoint
from modeling.expert_parallel import expert_order
from modeling.registry import config_from_dict, family_of, plan_of, plan_of_folder
from paddle_pp.interop.pretrained import TRANSFORMERS, load_pretrained, open_pretrained
from paddle_pp.interop.transformers import export_hf
from paddle_pp.runtime.launch import LaunchError, launch

import hf_models
from parity import our_logits
from runs import (
    MODEL,
    PP2,
    RESUME_STEP,
    TOKENIZER,
    TP2,
    TRAINER,
    Run,
    assert_trains_like,
    final_weight_drifts,
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
KINDS = list(hf_models.MOE_KINDS)


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
    return roots


def _our_model(folder, train: bool = False):
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    model = family_of(config).causal_lm(config)
    load_pretrained(pretrained, model, plan_of(config).axes(), None)
    model.train() if train else model.eval()
    return model, config


def _routed(model, ids: np.ndarray) -> list[np.ndarray]:
    """The fp32 router probabilities of every MoE layer on `ids`, as the model routed them."""
    probs = []
    for layer in model.sublayers():
        if type(layer).__name__ == "SparseMoE":
            route = layer.route
            layer.route = lambda flat, route=route: (lambda out: probs.append(out[0].numpy()) or out)(route(flat))
    with paddle.no_grad():
        model(paddle.to_tensor(ids))
    return probs


def _assert_margins(probs: list[np.ndarray], top_k: int) -> None:
    for layer_probs in probs:
        ranked = -np.sort(-np.log(layer_probs), axis=-1)  # logits up to a per-token constant
        gap = ranked[:, top_k - 1] - ranked[:, top_k]
        assert gap.min() > MARGIN, f"a token sits {gap.min():.2g} from a top-{top_k} tie: reseed the test folders"


@pytest.mark.parametrize("kind", KINDS)
def test_an_moe_folder_of_transformers_4_or_5_gives_their_logits(kind, moe_folders):
    for version, root in moe_folders.items():
        assert open_pretrained(root / kind).kind == TRANSFORMERS
        model, config = _our_model(root / kind)
        _assert_margins(_routed(model, IDS), config.num_experts_per_tok)
        np.testing.assert_allclose(our_logits(root / kind, IDS), np.load(root / f"{kind}.npy"), atol=LOGITS_TOL,
                                   rtol=LOGITS_TOL, err_msg=version)
    written5 = json.loads((moe_folders["transformers5"] / "qwen3_moe" / "config.json").read_text())
    assert "num_local_experts" in written5 and "num_experts" not in written5, "5.23 writes qwen3_moe the new way"


@pytest.mark.parametrize("kind", KINDS)
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
        assert [stored.get_slice(name).get_shape() for name in stored.keys() if name.endswith(
            "layers.0.mlp.experts.gate_up_proj")] == [[4, 2 * getattr(config, config.expert_width), 64]]
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
    saved = [router.gate.weight.numpy() for router in routers]
    for router in routers:
        router.gate.weight.set_value(np.zeros_like(router.gate.weight.numpy()))
    model.run.router_stats.take()
    model(ids)
    aux, _, _ = model.run.router_stats.take()
    np.testing.assert_allclose([float(v[0]) for v in aux.values()], config.router_aux_loss_coef, rtol=1e-6)

    for router, weight in zip(routers, saved):
        router.gate.weight.set_value(weight)
    labels = paddle.to_tensor(np.roll(IDS, -1, axis=1))
    loss, _ = model(ids, labels)
    loss.backward()
    injected = [router.gate.weight.grad.numpy().copy() for router in routers]
    model.clear_gradients()
    recorded = []
    for router in routers:
        route = router.route

        def keep(flat, route=route):
            probs, chosen, weights = route(flat)
            recorded.append((probs, chosen))
            return probs, chosen, weights
        router.route = keep
    coefficient, config.router_aux_loss_coef = config.router_aux_loss_coef, 0.0
    loss, _ = model(ids, labels)
    from modeling.blocks.moe import switch_aux_loss

    total = loss + sum(switch_aux_loss(probs, paddle.bincount(chosen.flatten(), minlength=config.num_experts),
                                       config.num_experts_per_tok) * coefficient for probs, chosen in recorded)
    total.backward()
    config.router_aux_loss_coef = coefficient
    for ours, reference in zip(injected, [router.gate.weight.grad.numpy() for router in routers]):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-9)


def test_received_rows_are_regrouped_by_expert_then_source():
    """Rank-local expert order of the rows an expert-parallel rank received: source 0 sent 1 row for
    expert 0 and 2 for expert 1, source 1 sent 3 for expert 0 and none for expert 1."""
    assert expert_order(np.array([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_order(np.zeros([2, 2], np.int64)).tolist() == []


def _start(kind: str, root) -> tuple[str, ...]:
    return ("--model_name_or_path", str(root / kind))


EP2, EP4 = ("--expert_parallel_degree", "2"), ("--expert_parallel_degree", "4")
DP2_TP2_PP2_SP = TP2 + PP2 + ("--sequence_parallel",)  # on 8 ranks: dp 2


@pytest.fixture(scope="module")
def moe_runs(moe_folders):
    """Qwen2-MoE (4 experts; a shared expert; layer 1 dense) from its transformers 4.55 folder: 20
    steps on one card; under dp2 x tp2 x pp2 + SP with its experts over ep2 (saving at step 10); under dp2 x
    sharding2 stage1 over ep2 with full recompute; under dp2 x sharding2 stage2 without ep; and the
    ep2 step-10 checkpoint resumed under ep4 (dp4, one expert per rank; an ep2 checkpoint resumed on
    one card: the kill test below)."""
    start = _start("qwen2_moe", moe_folders["transformers4"])
    single = Run("qwen2_moe_single", 1, start + ("--save_steps", "20"))
    hybrid = Run("qwen2_moe_ep2_tp2_pp2_sp", 8, start + DP2_TP2_PP2_SP + EP2 + ("--save_steps", str(RESUME_STEP)))
    return {"single": single, "ep2_tp2_pp2_sp": hybrid,
            "ep2_stage1": Run("qwen2_moe_ep2_stage1", 4, start + EP2 + (
                "--sharding_parallel_degree", "2", "--sharding", "stage1", "--recompute", "--save_steps", "20")),
            "stage2": Run("qwen2_moe_dp2_stage2", 4, start + ("--sharding_parallel_degree", "2", "--sharding", "stage2",
                                                              "--recompute", "--save_steps", "20")),
            "resumed_ep4": Run("qwen2_moe_resumed_ep4", 4, start + EP4, resume_from=hybrid)}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["ep2_tp2_pp2_sp", "ep2_stage1", "stage2"])
def test_qwen2_moe_trains_like_single_card(layout, moe_runs, pretrain_run, moe_folders, data_cache):
    """Losses, evaluation, grad norms, aux losses and final weights on the single-card run's; step
    1 is transformers' loss on the same batch; some expert of some layer gets no token in a step and
    nothing hangs (its gradient is a zero)."""
    single = history(pretrain_run, moe_runs["single"])
    assert min(single["router_margins"]) > MARGIN, "a token came near a top-k tie: reseed (hf_models.SEEDS)"
    folder = moe_folders["transformers4"] / "qwen2_moe"
    np.testing.assert_allclose(single["losses"][0], hf_models.loss(folder, first_batch(data_cache, folder, 20, 10)),
                               rtol=LOSS_RTOL)
    assert_trains_like(pretrain_run, moe_runs[layout], moe_runs["single"], PARITY_RTOL)
    np.testing.assert_allclose(history(pretrain_run, moe_runs[layout])["aux_losses"], single["aux_losses"],
                               rtol=PARITY_RTOL)
    assert single["losses"][-1] < single["losses"][0] - 0.5, "the model learns"


@pytest.mark.multiproc
def test_qwen2_moe_resumes_across_expert_parallel_sizes_on_the_single_card_curve(moe_runs, pretrain_run):
    """The ep2 checkpoint (each expert written by one of the ranks holding it, under its single-card
    name) gives every rank of ep4 exactly its weights and Adam states before the first step, and
    the run continues on the uninterrupted single-card curve."""
    results, _ = pretrain_run(moe_runs["resumed_ep4"])
    assert [r["resumed_exactly"] for r in results] == [True] * len(results)
    single = history(pretrain_run, moe_runs["single"])
    np.testing.assert_allclose(history(pretrain_run, moe_runs["resumed_ep4"])["losses"],
                               single["losses"][RESUME_STEP:], rtol=RESUME_RTOL)


@pytest.mark.multiproc
def test_an_expert_parallel_save_is_written_by_every_rank_as_the_planner_predicts(moe_runs, pretrain_run):
    """Each expert's tensors come from one of the ranks holding it (the planner's writer for each),
    every rank writes a share, and the checkpoint verifies."""
    run = moe_runs["ep2_tp2_pp2_sp"]
    _, out = pretrain_run(run)
    folder = out / f"checkpoint-{RESUME_STEP}"
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
    common = [*MODEL, *_start("qwen2_moe", moe_folders["transformers4"]), "--save_steps", "2", "--data_cache",
              str(data_cache), "--output_dir", str(out)]
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


EXPERT_COUNT_FIELD = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "olmoe": "num_experts"}
FOLDER_LAYOUTS = {"qwen3_moe": EP2 + DP2_TP2_PP2_SP, "mixtral": EP2 + TP2 + PP2, "olmoe": EP2 + DP2_TP2_PP2_SP}  # 8 ranks


def _folder_run(kind: str, root, nproc: int, layout: tuple[str, ...]) -> Run:
    return Run(f"{kind}_transformers5_{nproc}", nproc, _start(kind, root) + layout + (
        "--max_steps", str(FOLDER_STEPS), "--eval_steps", "0", "--warmup_steps", "1", "--save_steps",
        str(FOLDER_STEPS)))


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", list(EXPERT_COUNT_FIELD))
def test_a_transformers_5_folder_starts_under_expert_parallelism_at_its_loss_and_exports_for_both_versions(
        kind, moe_folders, pretrain_run, tmp_path):
    """Qwen3-MoE in transformers 5's spelling (`num_local_experts`, `rope_parameters`; its per-head
    q/k norms under ep2 x tp2 x pp2 + SP), Mixtral (block_sparse_moe, w1/w2/w3; ep2 x tp2 x pp2) and
    OLMoE (q/k norms over the whole projections, split over tp; ep2 x tp2 x pp2 + SP) start the trainer at transformers 5's loss; the
    export has the folder's tensor names, the expert count under the name both versions read, and
    our logits in transformers 4.55 and 5.23."""
    from safetensors import safe_open

    root = moe_folders["transformers5"]
    run = _folder_run(kind, root, 8, FOLDER_LAYOUTS[kind])
    results, out = pretrain_run(run)
    np.testing.assert_allclose(results[0]["losses"][0], json.loads((root / f"{kind}.json").read_text())["loss"],
                               rtol=LOSS_RTOL)
    checkpoint = out / f"checkpoint-{FOLDER_STEPS}"
    export = export_hf(checkpoint, tmp_path / "export")
    written = json.loads((export / "config.json").read_text())
    assert written[EXPERT_COUNT_FIELD[kind]] == 4 and set(EXPERT_COUNT_FIELD.values()) & set(written) == \
        {EXPERT_COUNT_FIELD[kind]}
    names = []
    for folder in (export, root / kind):
        with safe_open(str(folder / "model.safetensors"), "np") as stored:
            names.append(set(stored.keys()))
    assert names[0] == names[1]
    ours = our_logits(checkpoint, IDS)
    np.testing.assert_allclose(hf_models.logits(export, IDS), ours, atol=EXPORT_TOL, rtol=EXPORT_TOL)
    np.save(tmp_path / "ids.npy", IDS)
    hf_models.transformers5("logits", tmp_path / "ids.npy", export)
    np.testing.assert_allclose(np.load(f"{export}.npy"), ours, atol=EXPORT_TOL, rtol=EXPORT_TOL)


@pytest.mark.multiproc
def test_olmoe_q_k_norms_split_over_tp_train_like_single_card(moe_folders, pretrain_run):
    """OLMoE's norms over the whole q and k projections, each tp rank holding its heads' block
    (`SplitRMSNorm`): under ep2 x tp2 x pp2 + SP its losses and grad norms are the single-card run's
    (a block counted as replicated in the clip, or broadcast over tp, is not), and so are its q/k
    norm weights after 3 steps (measured: 1.2e-7). Other weights are held to the 20-step tolerance:
    Adam's first steps divide near-zero gradients by their own size, so a summation order moves
    some by 2e-5 (1.2e-5 under ep2 x pp2, which splits no norm)."""
    root = moe_folders["transformers5"]
    split, single = _folder_run("olmoe", root, 8, FOLDER_LAYOUTS["olmoe"]), _folder_run("olmoe", root, 1, ())
    for key in ("losses", "grad_norms"):
        np.testing.assert_allclose(history(pretrain_run, split)[key], history(pretrain_run, single)[key],
                                   rtol=RESUME_RTOL)
    drifts = final_weight_drifts(pretrain_run, split, single, step=FOLDER_STEPS)
    norms = {name: drift for name, drift in drifts.items() if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(norms) == 8 and max(norms.values()) < RESUME_RTOL, norms
    assert max(drifts.values()) < PARITY_RTOL, max(drifts.items(), key=lambda item: item[1])
