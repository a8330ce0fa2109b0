"""LoRA (`modeling/lora.py`, `paddle_pp/interop/lora_adapters.py`, `tools/lora.py`): adapters declared beside the
projections, trained on the frozen model under every layout on the single card's curve, resumed under another, and
carried out to PEFT (loaded by `peft` itself on transformers' model) and in from PaddleFormers (made by PaddleFormers
1.2 itself in the test). Fine-tuning data: chat samples (Qwen's template) through run_finetune's path."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import paddleformers_runs
import pytest
from chat_data import chat_tokenizer, jargon_chats, write_jsonl

from checkpoint.format import CheckpointError
from checkpoint.unified_io import UnifiedReader
from modeling.execution import Execution
from modeling.lora import ALL_LINEAR, LoRA, adapted_paths, with_adapters
from modeling.placement import COLUMN, ROW
from modeling.registry import config_from_dict, family_of, plan_of
from paddle_pp.interop.lora_adapters import AdapterError, adapter_arrays, export_merged, export_peft
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.interop.transformers import export_hf
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.model_config import ModelSourceError, model_config
from paddle_pp.training.run_plan import TrainingConfigError, check_lora

import hf_models
from parity import our_model
from runs import CORPUS

LORA = ("--lora", "--lora_rank", "4", "--lora_alpha", "16")
TARGETS = ["q_proj", "v_proj", "down_proj"]
CURVE_TOL, RESUME_TOL, PEFT_TOL, MERGE_TOL = 1e-4, 1e-5, 1e-5, 1e-6


def _config(lora: dict | None = None, **fields):
    values = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64) | fields
    return config_from_dict(values | ({"lora": lora} if lora else {}))


def test_adapters_are_declared_beside_the_projections_they_adapt():
    """Module names (PEFT's form) and whole-path regular expressions (PaddleFormers') pick projections; A and B follow
    their weight's tp split (column: B split as the weight; row: A split); all-linear leaves routers and the head."""
    lora = LoRA(4, 8.0, ("q_proj", r"llama\.layers\.1\.mlp\.down_proj"))
    plan = family_of(_config()).tensor_plan(_config(lora.to_dict()))
    assert adapted_paths(plan) == {"llama.layers.0.self_attn.q_proj", "llama.layers.1.self_attn.q_proj",
                                   "llama.layers.1.mlp.down_proj"}
    q, down = "llama.layers.0.self_attn.q_proj", "llama.layers.1.mlp.down_proj"
    assert plan[f"{q}.lora_A"].shape == (32, 4) and plan[f"{q}.lora_B"].shape == (4, 32)
    assert plan[f"{q}.lora_A"].placement.tp is None and plan[f"{q}.lora_B"].placement.tp == COLUMN
    assert plan[f"{down}.lora_A"].placement.tp == ROW and plan[f"{down}.lora_B"].placement.tp is None
    moe = config_from_dict(dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                max_position_embeddings=64))
    everything = adapted_paths(with_adapters(dict(plan_of(moe)), LoRA(4, 8.0, (ALL_LINEAR,))))
    assert "qwen3_moe.layers.0.mlp.experts.3.up_proj" in everything
    assert not any(path.endswith(("mlp.gate", "lm_head")) for path in everything)
    expert = with_adapters(dict(plan_of(moe)), LoRA(4, 8.0))["qwen3_moe.layers.0.mlp.experts.3.up_proj.lora_B"]
    assert expert.placement.expert == 3


def test_a_built_model_holds_its_planned_adapters_and_starts_as_the_base():
    """B starts at zero: the adapted model's logits are the base's; the model's check of its plan passes."""
    base_config, config = _config(), _config(LoRA(4, 8.0, tuple(TARGETS)).to_dict())
    paddle.seed(1)
    base = family_of(base_config).causal_lm(base_config)
    adapted = family_of(config).causal_lm(config)
    adapted.set_state_dict(base.state_dict())
    family_of(config).check_built(adapted, config, Execution(), 1, 0)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 64, size=(2, 9)))
    np.testing.assert_array_equal(adapted(ids).numpy(), base(ids).numpy())


@pytest.mark.parametrize("flags, message", [
    (["--lora", "--lora_target_modules", "c_fc"], "names no projection"),
    (["--lora", "--lora_dropout", "0.1", "--tensor_parallel_degree", "2"], "its own mask"),
    (["--lora", "--save_to_hf"], "no place for the adapters"),
])
def test_lora_flags_that_cannot_run_are_refused_in_the_plan(flags, message):
    args = parse_args(flags)
    config = model_config(args.model, 32, 64)
    with pytest.raises(TrainingConfigError, match=message):
        check_lora(args, config, Layout.from_args(args.layout, world_size=2, device="cpu"))


# The launches: transformers' LLaMA 3 and Qwen3-MoE folders (4 layers), adapters of rank 4 on every projection
# (experts included), 20 steps of chat samples of 64 tokens, saved at 10 and 20
@functools.cache
def _folders(root: str) -> dict[str, Path]:
    root = Path(root)
    tokenizer = chat_tokenizer("qwen", root / "tokenizer", CORPUS)
    data = write_jsonl(root / "chat.jsonl", jargon_chats(CORPUS, 96))
    folders = {"data": data, "tokenizer": tokenizer}
    for kind in ("llama3", "qwen3_moe"):
        folders[kind] = hf_models.make(kind, root / kind)
        for path in tokenizer.iterdir():
            shutil.copy(path, folders[kind])
    return folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _folders(str(tmp_path_factory.mktemp("lora_folders")))


FINETUNE = ("--max_seq_length", "64", "--truncation_strategy", "right", "--global_batch_size", "8",
            "--per_device_train_batch_size", "2", "--max_steps", "20", "--warmup_steps", "2", "--learning_rate", "2e-2",
            "--eval_steps", "10", "--eval_iters", "1", "--save_steps", "10", "--disable_progress_bar",
            "--calculate_per_token_loss", "--attention_core", "blockwise", "--packing") + LORA
TP2_PP2 = ("--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2")
LAYOUTS = {  # name: (folder, ranks, flags, resumed from)
    "llama_single": ("llama3", 1, (), None),
    "llama_tp2pp2": ("llama3", 4, TP2_PP2, None),
    "llama_resumed": ("llama3", 4, ("--sharding_parallel_degree", "2", "--sharding", "stage2",
                                    "--tensor_parallel_degree", "2"), "llama_single"),
    "moe_single": ("qwen3_moe", 1, (), None),
    "moe_ep2_tp2_pp2": ("qwen3_moe", 8, ("--expert_parallel_degree", "2", "--tensor_parallel_degree", "2",
                                         "--sequence_parallel") + TP2_PP2[2:], None),
    "moe_resumed": ("qwen3_moe", 4, ("--expert_parallel_degree", "2", "--pipeline_parallel_degree", "2"),
                    "moe_single"),
}


@pytest.fixture(scope="module")
def lora_runs(run_workers_module, folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runs")

    @functools.cache
    def run(name: str):
        kind, nproc, flags, resumed_from = LAYOUTS[name]
        if resumed_from is not None:
            _, source = run(resumed_from)
            flags += ("--resume_from_checkpoint", str(source / "checkpoint-10"), "--exit_after_steps", "4")
        out = root / name
        results = run_workers_module("pretrain_worker.py", nproc, [
            *FINETUNE, *flags, "--model_name_or_path", folders[kind], "--train_dataset_path", folders["data"],
            "--eval_dataset_path", folders["data"], "--output_dir", out], tag=name)
        return results[0], out

    return run


@pytest.mark.multiproc
@pytest.mark.parametrize("kind, layout", [("llama", "tp2pp2"), ("moe", "ep2_tp2_pp2")])
def test_lora_trains_on_the_single_card_curve(lora_runs, kind, layout):
    """LLaMA under tp2 x pp2, Qwen3-MoE (adapters on every expert) under ep2 x tp2 x pp2 + SP: 20 steps' losses, grad
    norms and evaluations within 1e-4 of one card's, and the adapters of step 20; only adapters are trained (the
    base weights of the checkpoint are the folder's, bit for bit) and only they have optimizer states."""
    expected, reference = lora_runs(f"{kind}_single")
    result, out = lora_runs(f"{kind}_{layout}")
    for key in ("losses", "grad_norms"):
        np.testing.assert_allclose(result[key], expected[key], rtol=CURVE_TOL)
    for step, loss in expected["eval_losses"].items():
        np.testing.assert_allclose(result["eval_losses"][step], loss, rtol=CURVE_TOL)
    assert np.mean(expected["losses"][-5:]) < expected["losses"][0] - 0.05, "the adapters learn (on a frozen random base)"
    ours, theirs = (UnifiedReader(folder / "checkpoint-20", "model") for folder in (out, reference))
    adapters = [name for name in theirs.tensors if "lora_" in name]
    for name in adapters:
        value = theirs.read(name)
        assert np.linalg.norm(ours.read(name) - value) <= CURVE_TOL * np.linalg.norm(value), name
    folder = open_pretrained(_folders_of(reference))
    for name in theirs.tensors:
        if "lora_" not in name:
            np.testing.assert_array_equal(theirs.read(name), folder.read(name, None, 1, 0), err_msg=name)
    states = UnifiedReader(reference / "checkpoint-20", "optimizer").tensors
    assert {name.split("/")[0] for name in states} == set(adapters)


def _folders_of(out: Path) -> Path:
    """The model folder a run started from (its trainer state's arguments)."""
    state = json.loads((out / "checkpoint-20" / "trainer_state.json").read_text())
    return Path(state["args"]["model_name_or_path"])


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_a_lora_checkpoint_resumes_under_another_layout_on_the_curve(lora_runs, kind):
    """The single card's step-10 adapters and their Adam states, resumed under tp2 x sharding2 stage2 (LLaMA)
    and ep2 x pp2 (Qwen3-MoE): every weight and state read back exact, steps 11-14 within 1e-5."""
    expected, _ = lora_runs(f"{kind}_single")
    resumed, _ = lora_runs(f"{kind}_resumed")
    assert resumed["resumed_exactly"] is True
    np.testing.assert_allclose(resumed["losses"], expected["losses"][10:14], rtol=RESUME_TOL)


@pytest.mark.multiproc
def test_the_planner_counts_gradients_and_states_of_the_adapters_only(lora_runs):
    """`tools/reshard.py plan`'s memory model of a LoRA run: the weights of the whole model, gradients and Adam's
    two moments of the adapters alone, as the trained checkpoint's optimizer holds them."""
    from checkpoint.format import STATE_SEPARATOR
    from modeling.registry import load_config
    from paddle_pp.planning.memory import plan_layout

    _, out = lora_runs("llama_single")
    checkpoint = out / "checkpoint-20"
    config = load_config(checkpoint)
    (share,) = plan_layout(config, Layout.from_args(parse_args([]).layout, world_size=1, device="cpu"))
    states = UnifiedReader(checkpoint, "optimizer")
    moments = sum(int(np.prod(meta["shape"])) for name, meta in states.tensors.items()
                  if name.split(STATE_SEPARATOR)[-1].startswith("moment"))
    weights = sum(int(np.prod(meta["shape"])) for meta in UnifiedReader(checkpoint, "model").tensors.values())
    adapters = sum(int(np.prod(meta["shape"])) for name, meta in UnifiedReader(checkpoint, "model").tensors.items()
                   if "lora_" in name)
    assert share.parameters == weights and share.grad_bytes == 4 * adapters
    assert share.optimizer_bytes == 4 * moments == 8 * adapters


IDS = np.random.default_rng(3).integers(0, 2048, size=(2, 16))


@pytest.mark.multiproc
def test_the_peft_folder_loads_in_peft_with_our_logits_and_our_merge_is_peft_merge(lora_runs, tmp_path):
    """`tools/lora.py peft` of the trained LLaMA: PEFT's PeftModel on transformers' model of the base folder gives our
    logits (1e-5); `tools/lora.py merge` equals PEFT's merge_and_unload, tensor by tensor (1e-6 of each's largest)."""
    import peft
    import torch

    _, out = lora_runs("llama_single")
    checkpoint = out / "checkpoint-20"
    export_peft(checkpoint, tmp_path / "peft")
    settings = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert settings["r"] == 4 and settings["lora_alpha"] == 16 and len(settings["target_modules"]) == 28
    base = hf_models.reference_model(_folders_of(out))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        theirs = adapted(torch.tensor(IDS)).logits.numpy()
    model = our_model(checkpoint)
    model.eval()
    with paddle.no_grad():
        ours = model(paddle.to_tensor(IDS)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=PEFT_TOL, atol=PEFT_TOL * np.abs(theirs).max())
    merged = adapted.merge_and_unload().state_dict()
    ours_merged = hf_models.reference_model(export_merged(checkpoint, tmp_path / "merged")).state_dict()
    assert merged.keys() == ours_merged.keys()
    for name, value in merged.items():
        np.testing.assert_allclose(ours_merged[name].numpy(), value.numpy(), rtol=MERGE_TOL,
                                   atol=MERGE_TOL * float(value.abs().max()), err_msg=name)
    untouched = hf_models.reference_model(_folders_of(out)).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - untouched[q]).abs().max()) > 1e-3 * float(untouched[q].abs().max()), "merged nothing"
    with pytest.raises(CheckpointError, match="tools/lora.py"):
        export_hf(checkpoint, tmp_path / "refused")


@pytest.mark.multiproc
def test_a_run_starts_its_adapters_from_a_peft_folder(lora_runs, run_workers_module, folders, tmp_path):
    """--lora_path of the trained LLaMA's PEFT folder: the run's adapters are those the folder came from, exactly
    (one step at learning rate 0, saved)."""
    _, out = lora_runs("llama_single")
    export_peft(out / "checkpoint-20", tmp_path / "peft")
    run_workers_module("pretrain_worker.py", 1, [
        *FINETUNE, "--max_steps", "1", "--warmup_steps", "0", "--learning_rate", "0", "--min_learning_rate", "0",
        "--save_steps", "1",
        "--model_name_or_path", folders["llama3"], "--train_dataset_path", folders["data"], "--lora_path",
        tmp_path / "peft", "--output_dir", tmp_path / "run"], tag="from_peft")
    started, trained = (UnifiedReader(folder, "model") for folder in (tmp_path / "run" / "checkpoint-1",
                                                                      out / "checkpoint-20"))
    adapters = [name for name in trained.tensors if "lora_" in name]
    assert len(adapters) == 56
    for name in adapters:
        np.testing.assert_array_equal(started.read(name), trained.read(name), err_msg=name)


def test_a_paddleformers_lora_folder_gives_paddleformers_logits(tmp_path):
    """PaddleFormers 1.2's LoRAModel (q, v and down projections, rank 4, alpha 8, its B drawn non-zero) on its own
    LLaMA, saved as PaddleFormers saves adapters (lora_config.json + peft_model-*.safetensors): read by --lora_path's
    reader, our model with those adapters gives PaddleFormers' logits (1e-5)."""
    rows = np.random.default_rng(0).integers(0, 4096, size=(8, 33))
    np.save(tmp_path / "rows.npy", rows)
    np.save(tmp_path / "ids.npy", IDS)
    paddleformers_runs.run("train", tmp_path, tmp_path / "rows.npy", 1, 1, "flex_checkpoint", "{}")
    paddleformers_runs.run("lora", tmp_path / "start", tmp_path / "lora", tmp_path / "ids.npy", json.dumps(
        {"r": 4, "lora_alpha": 8, "target_modules": [f".*{name}.*" for name in TARGETS]}))
    pretrained = open_pretrained(tmp_path / "start")
    config = config_from_dict(pretrained.config | {"lora": LoRA(4, 8.0, tuple(TARGETS)).to_dict()})
    model = family_of(config).causal_lm(config)
    plan = plan_of(config)
    from dataclasses import replace

    load_pretrained(replace(pretrained, fresh=tuple(name for name in plan if "lora_" in name)), model, plan.axes(),
                    None)
    settings, arrays = adapter_arrays(tmp_path / "lora", config)
    assert (settings.rank, settings.alpha) == (4, 8.0) and len(arrays) == 2 * 3 * 4
    state = model.state_dict()
    for name, value in arrays.items():
        state[name].set_value(value)
    model.eval()
    with paddle.no_grad():
        ours = model(paddle.to_tensor(IDS)).numpy()
    theirs = np.load(tmp_path / "lora" / "logits.npy")
    np.testing.assert_allclose(ours, theirs, rtol=PEFT_TOL, atol=PEFT_TOL * np.abs(theirs).max())
    wrong = config_from_dict(pretrained.config | {"lora": LoRA(4, 8.0, ("o_proj",)).to_dict()})
    with pytest.raises(AdapterError, match="o_proj"):
        adapter_arrays(tmp_path / "lora", wrong)


@pytest.mark.multiproc
def test_a_lora_checkpoint_starts_or_resumes_only_with_its_adapters(lora_runs, run_workers_module, folders, tmp_path):
    """The trained LLaMA's checkpoint: as --model_name_or_path without --lora or with another rank it is refused
    (its adapters would be dropped or started again), with its settings the run starts from its adapters exactly
    (one step at learning rate 0); resuming it without --lora is refused before any process group, by name."""
    from checkpoint.load import check_compatible

    _, out = lora_runs("llama_single")
    checkpoint = out / "checkpoint-20"
    pretrained = open_pretrained(checkpoint)
    for flags in ([], [*LORA[:2], "8", *LORA[3:]]):
        args = parse_args(["--model_name_or_path", str(checkpoint), *flags])
        with pytest.raises(ModelSourceError, match="holds LoRA adapters"):
            model_config(args.model, 64, 2048, pretrained, args.given)
    args = parse_args(["--model_name_or_path", str(folders["llama3"])])
    with pytest.raises(CheckpointError, match="lora is"):
        check_compatible(checkpoint, model_config(args.model, 64, 2048, open_pretrained(folders["llama3"]),
                                                  args.given), Layout.from_args(args.layout, 1, "cpu"))
    run_workers_module("pretrain_worker.py", 1, [
        *FINETUNE, "--max_steps", "1", "--warmup_steps", "0", "--learning_rate", "0", "--min_learning_rate", "0",
        "--save_steps", "1", "--model_name_or_path", checkpoint, "--train_dataset_path", folders["data"],
        "--output_dir", tmp_path / "run"], tag="from_lora_checkpoint")
    started, trained = (UnifiedReader(folder, "model") for folder in (tmp_path / "run" / "checkpoint-1", checkpoint))
    adapters = [name for name in trained.tensors if "lora_" in name]
    assert len(adapters) == 56
    for name in adapters:
        np.testing.assert_array_equal(started.read(name), trained.read(name), err_msg=name)
