"""The planner and the trainer decide from one plan (`paddle_pp/training/run_plan.py`): for a table of
requests, one per refusal the plan holds, `tools/reshard.py plan` and `run_pretrain.py` refuse with the
same message, and accepted requests are accepted by both. The trainer's side is its real entry point
as rank 0 of an N-rank launch whose other ranks never start (tests/workers/refusal_worker.py): a
refusal made after a process group exists would wait for them, and the timeout fails the test."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from modeling.registry import config_from_dict

from runs import REPO

sys.path.insert(0, str(REPO / "tools"))
import reshard  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "refusal_worker.py"
SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
MODELS = {
    "llama8": dict(model_type="llama", num_hidden_layers=8, **SHAPE),
    "gpt": dict(model_type="gpt", vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256),
    "mpt": dict(model_type="mpt", vocab_size=4096, d_model=64, n_heads=4, n_layers=2, max_seq_len=256),
    "llama8_tied": dict(model_type="llama", num_hidden_layers=8, tie_word_embeddings=True, **SHAPE),
    "qwen3_5": dict(model_type="qwen3_5_text", num_hidden_layers=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    layer_types=["linear_attention", "full_attention"], **SHAPE),
}
SEQ = ("--max_seq_length", "64")
PP2, PP4 = ("--pipeline_parallel_degree", "2"), ("--pipeline_parallel_degree", "4")
VPP2, DUALPIPEV = ("--virtual_pp_degree", "2"), ("--pipeline_schedule", "DualPipeV")


def accumulate(steps: int) -> tuple[str, ...]:
    return ("--gradient_accumulation_steps", str(steps))



# (model, world size, flags, a fragment of the refusal both must print)
REFUSED = [
    ("llama8", 4, ("--pipeline_parallel_degree", "4", "--virtual_pp_degree", "2", "--gradient_accumulation_steps",
                   "2"), "--virtual_pp_degree needs at least --pipeline_parallel_degree 4 micro-batches"),
    ("llama8", 2, ("--global_batch_size", "6", "--per_device_train_batch_size", "2"),
     "--global_batch_size 6 is not divisible"),
    ("llama8", 1, ("--warmup_steps", "20", "--max_steps", "10"), "--warmup_steps 20 must lie in [0, --max_steps 10]"),
    ("llama8", 1, ("--bf16",), "--bf16 needs a GPU"),
    ("llama8", 1, ("--amp_master_grad",), "--amp_master_grad needs --bf16 or --fp16"),
    ("gpt", 1, ("--hidden_dropout_prob", "0.1"), "dropout is not modelled"),
    ("llama8", 1, ("--recompute", "--pp_recompute_interval", "2"), "--pp_recompute_interval 2"),
    ("llama8", 2, ("--context_parallel_degree", "2", "--no-use_flash_attention"),
     "the dense attention core keeps no log-sum-exp"),
    ("llama8", 2, ("--context_parallel_degree", "2", "--attention_core", "dense"),
     "--attention_core dense: the dense attention core keeps no log-sum-exp"),
    ("llama8", 1, ("--attention_core", "blockwise", "--no-use_flash_attention"),
     "--no-use_flash_attention asks for the dense core and --attention_core blockwise"),
    ("llama8", 3, ("--tensor_parallel_degree", "3"), "vocab_size=4096 is not divisible by --tensor_parallel_degree 3"),
    ("llama8", 2, ("--expert_parallel_degree", "2"), "which has no experts"),
    ("llama8", 2, ("--sharding_parallel_degree", "2"), "needs --sharding stage1"),
    ("llama8", 2, ("--context_parallel_degree", "2", "--max_seq_length", "66"), "is not divisible by 2 x"),
    ("mpt", 2, ("--context_parallel_degree", "2"), "decoder layer 0 has ALiBi position biases"),
    ("qwen3_5", 4, ("--context_parallel_degree", "4", "--max_seq_length", "16"),
     "parts of 2 tokens, and decoder layer 0's conv (kernel 4) takes 3 from the part before"),
    ("llama8", 2, ("--sequence_parallel",), "--sequence_parallel needs --tensor_parallel_degree >= 2"),
    # the pipeline schedules (planning/schedules.py, Layout._check_schedule)
    ("llama8", 4, PP4 + VPP2 + accumulate(6), "FThenB asserts a multiple of --pipeline_parallel_degree 4"),
    ("llama8", 2, PP2 + VPP2 + accumulate(2) + ("--pipeline_schedule", "VPP"),
     "--pipeline_schedule VPP runs with at least 2 x --pipeline_parallel_degree = 4 micro-batches"),
    ("llama8", 2, PP2 + ("--pipeline_schedule", "VPP"),
     "interleaves virtual stages: it needs --virtual_pp_degree >= 2"),
    ("llama8", 1, ("--pipeline_schedule", "1F1B"), "--pipeline_schedule 1F1B needs --pipeline_parallel_degree >= 2"),
    ("llama8", 2, PP2 + DUALPIPEV + accumulate(2),
     "--pipeline_schedule DualPipeV needs at least 2 x --pipeline_parallel_degree = 4 micro-batches"),
    ("llama8", 2, PP2 + DUALPIPEV + VPP2 + accumulate(4), "DualPipeV places its own two chunks per stage"),
    ("llama8", 5, ("--pipeline_parallel_degree", "5") + DUALPIPEV + accumulate(10),
     "fewer than --pipeline_parallel_degree 5 x DualPipeV's 2 = 10 chunks"),
    ("llama8_tied", 2, PP2 + DUALPIPEV + accumulate(4), "--pipeline_schedule DualPipeV with tie_word_embeddings=true"),
]
ACCEPTED = [("llama8", 1, ()), ("llama8", 1, ("--attention_core", "blockwise"))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_plan_models")
    for name, fields in MODELS.items():
        config_from_dict(dict(fields)).save_pretrained(str(root / name))
    return {name: root / name for name in MODELS}


def _planner(folder: Path, world_size: int, flags) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
        code = reshard.main(["plan", "--config", str(folder / "config.json"), "--world_size", str(world_size),
                             "--device", "cpu", *SEQ, *flags])
    errors = [line for line in printed.getvalue().splitlines() if line.startswith("reshard.py: error: ")]
    return code, errors[-1].removeprefix("reshard.py: error: ") if errors else ""


def _trainer_argv(folder: Path, out: Path, flags) -> list[str]:
    return ["--model_name_or_path", str(folder), "--no-continue_training", *SEQ, "--output_dir", str(out), *flags]


def test_the_planner_and_the_trainer_refuse_alike_before_any_collective(folders, tmp_path):
    requests = [[world, _trainer_argv(folders[model], tmp_path / f"out{i}", flags)]
                for i, (model, world, flags, _) in enumerate(REFUSED)]
    table = tmp_path / "requests.json"
    table.write_text(json.dumps(requests))
    done = subprocess.run([sys.executable, str(WORKER), str(table)], capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    trainer = json.loads(done.stdout.strip().splitlines()[-1])
    for (model, world, flags, fragment), (code, message) in zip(REFUSED, trainer):
        planned_code, planned = _planner(folders[model], world, flags)
        assert code == 2 and fragment in message, (flags, message)
        assert planned_code == 1 and planned == message, (flags, planned, message)


@pytest.mark.parametrize("request_", ACCEPTED, ids=lambda r: " ".join(r[2]) or "defaults")
def test_the_planner_and_the_trainer_accept_alike(folders, tmp_path, data_cache, request_):
    model, world, flags = request_
    assert _planner(folders[model], world, flags) == (0, "")
    done = subprocess.run([sys.executable, str(REPO / "run_pretrain.py"),
                           *_trainer_argv(folders[model], tmp_path / "out", flags), "--max_steps", "1", "--warmup_steps", "0",
                           "--do_eval", "false", "--disable_progress_bar", "--data_cache", str(data_cache)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
