"""PaddleNLP's recipe files as users run them (`run_pretrain.py recipe.json [--flag value]`, or
`--config recipe.json`): each failure a new user met with PaddleNLP's own llm/config and benchmark
recipes, as a test that fails without its fix; a recipe shaped like PaddleNLP's llama one trains on
4 ranks from a local model folder, and its Qwen2.5-0.5B single-card recipe trains on one process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import first_batch

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout, LayoutError
from paddle_pp.training.arguments import build_parser, parse_args
from paddle_pp.training.model_config import ModelSourceError
from paddle_pp.training.recipes import RecipeError, read_recipe
from paddle_pp.training.run_plan import run_execution
from paddle_pp.training.trainer import Pretrainer

import hf_models
from runs import REPO, SCRIPT, TRAINER

LOSS_RTOL = 1e-5  # step 1's loss is a forward of the same fp32 weights on the same batch
KNOWN = {action.dest for action in build_parser()._actions}
CPU_LAYOUT = Layout(world_size=1, device="cpu")
# shaped like PaddleNLP's llm/config/llama/pretrain_argument.json (its values where CPU and the test
# model allow; bf16 dropped: CPU has none; a local folder for its hub id; the shipped corpus for ./data;
# 3 steps, so 1 warmup step)
LLAMA_RECIPE = {
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4, "per_device_eval_batch_size": 2,
    "tensor_parallel_degree": 2, "pipeline_parallel_degree": 1, "sharding": "stage2", "virtual_pp_degree": 1,
    "sequence_parallel": 0, "use_flash_attention": True, "use_fused_rms_norm": True, "use_fused_rope": True,
    "max_seq_length": 32, "learning_rate": 3e-05, "min_learning_rate": 3e-06, "warmup_steps": 1, "logging_steps": 1,
    "max_steps": 3, "save_steps": 5000, "eval_steps": 1000, "weight_decay": 0.01, "fp16_opt_level": "O2",
    "warmup_ratio": 0.01, "max_grad_norm": 1.0, "dataloader_num_workers": 1, "continue_training": 1,
    "do_train": True, "do_eval": True, "do_predict": True, "disable_tqdm": True, "recompute": False,
    "distributed_dataloader": 1, "recompute_granularity": "full", "unified_checkpoint": True, "save_total_limit": 2}


def _recipe(tmp_path, values: dict, name: str = "recipe.json"):
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return path


def test_a_recipe_takes_paddlenlps_defaults_names_what_changes_nothing_and_refuses_the_rest(tmp_path):
    path = _recipe(tmp_path, {"max_steps": 10, "use_fused_rope": True, "tokenizer_name_or_path": "tok",
                              "fuse_attention_qkv": True, "learning_rate": 1e-4, "sequence_parallel": 1,
                              "recompute": False, "recompute_granularity": "full_attn",
                              "pipeline_parallel_config": "enable_delay_scale_loss disable_partial_send_recv"})
    flags, notes = read_recipe(path, KNOWN, {"continue_training", "sequence_parallel", "use_fused_rope", "recompute"})
    assert flags["sequence_parallel"] is True and flags["use_fused_rope"] is True
    assert flags["lr_scheduler_type"] == "linear" and flags["continue_training"] is False  # PaddleNLP's defaults
    assert flags["use_flash_attention"] is False and flags["hidden_dropout_prob"] == 0.1
    assert flags["tokenizer_dir"] == "tok" and flags["learning_rate"] == 1e-4 and flags["eval_steps"] == 500
    assert flags["resume_from_checkpoint"] == "latest"  # run_pretrain.py resumes output_dir's newest checkpoint
    assert "fuse_attention_qkv (a kernel" in notes[0]
    for refused, words in (({"fancy_new_field": 1}, "fancy_new_field=1 (a field paddle-pp does not know"),
                           ({"no_recompute_layers": [1]}, "no_recompute_layers=[1]"),
                           ({"fp16_opt_level": "O1"}, "fp16_opt_level='O1'"),
                           ({"tensor_parallel_config": "enable_mp_async_allreduce some_new_option"},
                            "tensor_parallel_config option(s) some_new_option"),
                           ({"pipeline_parallel_config": "best_unbalanced_scheduler"},
                            "pipeline_parallel_config option(s) best_unbalanced_scheduler")):
        with pytest.raises(RecipeError, match=re.escape(words)):
            read_recipe(_recipe(tmp_path, {"max_steps": 10, **refused}), KNOWN, set())
    # the option that picks fleet's DualPipeV class is a schedule here
    flags, _ = read_recipe(_recipe(tmp_path, {"max_steps": 10, "pipeline_parallel_config": "use_dualpipev "
                                              "disable_partial_send_recv"}), KNOWN, set())
    assert flags["pipeline_schedule"] == "DualPipeV"
    # context and expert parallelism are modelled; PaddleNLP's all-to-all segment parallelism is refused by the layout
    args = parse_args([str(_recipe(tmp_path, {"max_steps": 3, "context_parallel_degree": 2, "sep_parallel_degree": 2,
                                              "expert_parallel_degree": 2, "use_expert_parallel": True}))])
    assert args.layout.context_parallel_degree == 2 and args.layout.expert_parallel_degree == 2
    with pytest.raises(LayoutError, match="--sep_parallel_degree 2: PaddleNLP's segment parallelism"):
        Layout.from_args(args.layout, world_size=4, device="cpu")


def test_use_flash_attention_chooses_the_memory_efficient_core(tmp_path):
    """Was "ignored: a kernel or fusion choice" while the dense core kept every score."""
    args = parse_args([str(_recipe(tmp_path, {"max_steps": 3, "use_flash_attention": True}))])
    assert run_execution(args.model, CPU_LAYOUT, None, 64, 2)[0].attention.name == "blockwise"
    args = parse_args([str(_recipe(tmp_path, {"max_steps": 3}))])  # PaddleNLP's default: no flash
    assert run_execution(args.model, CPU_LAYOUT, None, 64, 2)[0].attention.name == "dense"


def test_recompute_granularity_counts_only_with_recompute(tmp_path):
    """Three benchmark recipes set recompute_granularity full_attn with recompute false: was refused."""
    args = parse_args([str(_recipe(tmp_path, {"max_steps": 3, "recompute": False,
                                              "recompute_granularity": "full_attn"}))])
    assert run_execution(args.model, CPU_LAYOUT, None, 64, 2)[0].recompute.granularity is None
    args = parse_args(["--recompute", "1", "--recompute_granularity", "core_attn"])
    assert run_execution(args.model, CPU_LAYOUT, None, 64, 2)[0].recompute.granularity == "core_attn"
    with pytest.raises(UserError, match="--pp_recompute_interval 2"):
        run_execution(parse_args(["--recompute", "--pp_recompute_interval", "2"]).model,
                      CPU_LAYOUT, None, 64, 2)


@pytest.mark.parametrize("form, value", [(["--recompute"], True), (["--recompute", "1"], True),
                                         (["--recompute", "true"], True), (["--recompute", "false"], False),
                                         (["--recompute", "0"], False), (["--no-recompute"], False)])
def test_boolean_flags_take_paddlenlps_forms(form, value):
    """`--recompute 1` failed with "1: a recipe is a PaddleNLP .json argument file"."""
    assert parse_args(form).model.recompute is value
    assert parse_args(["--use_flash_attention", "true" if value else "false"]).model.use_flash_attention is value


def test_config_takes_a_json_recipe(tmp_path):
    """`--config recipe.json` failed with "unknown keys"."""
    args = parse_args(["--config", str(_recipe(tmp_path, {"max_steps": 7, "learning_rate": 1e-4})),
                       "--max_steps", "9"])
    assert (args.optim.max_steps, args.optim.learning_rate, args.optim.lr_scheduler_type) == (9, 1e-4, "linear")
    assert not args.optim.warmup_from_zero  # PaddleNLP's pretraining warms up by (step + 1) / warmup


def test_amp_master_grad_with_micro_batches_is_accepted(tmp_path):
    """4 of the 8 benchmark recipes (4 to 1024 micro-batches) were refused; the bookkeeping is proven in
    test_mixed_precision.py."""
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.training import precision

    args = parse_args([str(_recipe(tmp_path, {"max_steps": 3, "bf16": True, "amp_master_grad": True,
                                              "gradient_accumulation_steps": 32}))])
    assert args.optim.amp_master_grad and args.data.gradient_accumulation_steps == 32
    assert precision.compute_dtype(True, False, True, Layout(world_size=1, device="gpu")) == "bfloat16"


def test_a_gpt_recipe_silent_on_dropout_is_refused(tmp_path):
    """PaddleNLP's run_pretrain gives GPT dropout 0.1 unless the recipe says otherwise; GPT trained
    without it silently. Dropout is not modelled here: 0 is accepted, anything else refused."""
    gpt = {"max_steps": 3, "model_type": "gpt", "num_key_value_heads": 0, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_seq_length": 32, "output_dir": str(tmp_path / "out")}
    with pytest.raises(ModelSourceError, match="hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1"):
        Pretrainer(parse_args([str(_recipe(tmp_path, gpt))]))
    off = parse_args([str(_recipe(tmp_path, {**gpt, "hidden_dropout_prob": 0, "attention_probs_dropout_prob": 0}))])
    assert off.model.hidden_dropout_prob == 0 and off.model.attention_probs_dropout_prob == 0


def test_a_hub_id_says_there_is_no_network(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(_recipe(tmp_path, {
        "model_name_or_path": "meta-llama/Meta-Llama-3-8B", "max_steps": 3, "output_dir": str(tmp_path / "out")}))],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "reads like a model hub id" in done.stderr and "local folder" in done.stderr
    assert "Traceback" not in done.stderr


def test_paddlenlps_llama_recipe_on_one_process_names_the_launcher(tmp_path):
    """tp2 with sharding over every other rank on one process was a ZeroDivisionError traceback."""
    done = subprocess.run([sys.executable, str(SCRIPT), str(_recipe(tmp_path, {**LLAMA_RECIPE, "output_dir": str(
        tmp_path / "out")}))], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--tensor_parallel_degree 2" in done.stderr and "--nproc_per_node 2" in done.stderr
    assert "Traceback" not in done.stderr and "ZeroDivisionError" not in done.stderr


@pytest.mark.multiproc
def test_paddlenlps_llama_recipe_trains_on_4_ranks_from_a_local_folder(run_workers, transformers4_folders,
                                                                      data_cache, tmp_path):
    """tp2 x sharding2 stage2, flash (on CPU at 1,000 tokens the dense core, the faster there), fused
    rope and RMSNorm (noted: no CPU kernel), 4 micro-batches of 1: step 1 is transformers' loss on the
    same batch, the notes name what CPU changed, and VisualDL reads back the scalars of metrics.jsonl."""
    from visualdl import LogReader

    folder = transformers4_folders / "llama"
    recipe = _recipe(tmp_path, {**LLAMA_RECIPE, "model_name_or_path": str(folder), "report_to": "visualdl",
                                "logging_dir": str(tmp_path / "vdl")}, "pretrain_argument.json")
    out = tmp_path / "out"
    result, *_ = run_workers(TRAINER, 4, [recipe, "--data_cache", data_cache, "--output_dir", out], timeout=400,
                             tag="llama_recipe")
    expected = hf_models.loss(folder, first_batch(data_cache, folder, 3, 1000))
    np.testing.assert_allclose(result["losses"][0], expected, rtol=LOSS_RTOL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = LogReader(file_path=str(next((tmp_path / "vdl").glob("vdlrecords.*")))).get_data("scalar", "train/loss")
    assert [s.id for s in scalars] == [r["step"] for r in records] == [1, 2, 3]
    np.testing.assert_allclose([s.value for s in scalars], [r["loss"] for r in records], rtol=1e-6)
    log = "".join(path.read_text() for path in (tmp_path / "llama_recipe").rglob("workerlog.0"))
    assert "attention: dense core (flash attention not used: no CUDA GPU" in log
    assert "the faster on CPU under 1024 tokens" in log and "--use_fused_rope ignored on cpu" in log


def test_qwens_single_card_recipe_with_stage2_trains_unsharded(transformers4_folders, data_cache, tmp_path):
    """PaddleNLP's documented one-card command for Qwen2.5-0.5B runs a recipe with sharding stage2 on
    one process: it was refused (--sharding stage2 needs --sharding_parallel_degree >= 2)."""
    recipe = _recipe(tmp_path, {
        "model_name_or_path": str(transformers4_folders / "qwen2"), "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1, "per_device_eval_batch_size": 2, "tensor_parallel_degree": 1,
        "pipeline_parallel_degree": 1, "sharding": "stage2", "virtual_pp_degree": 1, "sequence_parallel": 0,
        "use_flash_attention": False, "use_fused_rms_norm": False, "max_seq_length": 32, "learning_rate": 3e-05,
        "min_learning_rate": 3e-06, "warmup_steps": 1, "logging_steps": 1, "max_steps": 3, "save_steps": 5000,
        "eval_steps": 1000, "weight_decay": 0.01, "fp16_opt_level": "O2", "warmup_ratio": 0.01, "max_grad_norm": 1.0,
        "dataloader_num_workers": 1, "continue_training": 0, "do_train": True, "do_eval": True, "do_predict": True,
        "disable_tqdm": True, "recompute": False, "distributed_dataloader": 1, "recompute_granularity": "full",
        "unified_checkpoint": True, "save_total_limit": 2, "output_dir": str(tmp_path / "out")})
    # flags over the recipe, as in PaddleNLP; do_eval false means no evaluation at all (the last step evaluated)
    done = subprocess.run([sys.executable, str(SCRIPT), str(recipe), "--data_cache", str(data_cache), "--do_eval",
                           "false"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--sharding stage2 over one sharding rank means no sharding" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)
    assert not any("eval_loss" in r for r in records)
