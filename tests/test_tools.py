"""tools/: each command line over its library function, on a checkpoint a real run wrote."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoint.save_plan import estimate_save, save_items
from checkpoint.shards import ShardReader
from checkpoint.unified_io import rechunk
from checkpoint.verify import verify_checkpoint
from checkpoint.writers import assign_writers
from modeling.registry import config_from_dict, load_config, plan_of, plan_of_folder
from paddle_pp.interop.transformers import export_hf, import_hf
from paddle_pp.planning.memory import plan_layout
from paddle_pp.runtime.layout import Layout, LayoutError

from runs import MODEL, REPO, SCRIPT

TOOLS = REPO / "tools"


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, data_cache) -> tuple[Path, subprocess.CompletedProcess]:
    """A one-card run as a user starts it (`python run_pretrain.py`), saving at step 2."""
    out = tmp_path_factory.mktemp("run")
    done = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--max_steps", "6", "--warmup_steps", "1",
                           "--exit_after_steps", "2", "--save_steps", "2", "--data_cache", str(data_cache),
                           "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, done


@pytest.fixture(scope="module")
def checkpoint(plain_run):
    return plain_run[0] / "checkpoint-2"


def test_a_one_card_run_prints_its_own_lines_only(plain_run):
    """No start-up note of Paddle's, PaddleNLP's or setuptools' reaches the terminal of a one-card run
    (fleet's flags banner, INFO lines and one-process warnings, ccache, distutils, datasets' PyTorch
    line): what it prints (progress bar off) is its own notes."""
    _, done = plain_run
    assert done.stdout == ""
    assert done.stderr and all(line.startswith("note: ") for line in done.stderr.splitlines()), done.stderr


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        reader = ShardReader(shard)
        tensors |= {name: reader.read(name) for name in reader.names}
    return tensors


def test_plan_sizes_every_rank_and_covers_the_model(checkpoint):
    config = load_config(checkpoint)
    layout = Layout(world_size=8, tensor_parallel_degree=2, pipeline_parallel_degree=2, sharding_parallel_degree=2,
                    sharding="stage1", device="gpu")
    shares = plan_layout(config, layout)
    assert {(s.stage, s.tp_rank) for s in shares} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    held = sum(int(np.prod(row.shape)) * (1 if row.placement.tp is not None else 2)  # replicated: on both tp ranks
               for row in plan_of(config).values())
    assert sum(s.parameters for s in shares) == held
    assert all(s.optimizer_bytes == s.parameters * 8 // 2 for s in shares), "AdamW states are sharded over 2"
    tool = subprocess.run([sys.executable, str(TOOLS / "reshard.py"), "plan", "--checkpoint", str(checkpoint),
                           "--world_size", "8", "--tensor_parallel_degree", "2", "--pipeline_parallel_degree", "2"],
                          capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0 and "valid" in tool.stdout, tool.stderr[-1000:]


@pytest.mark.parametrize("stage, weights, grads", [("stage1", 1, 1), ("stage2", 1, 4), ("stage3", 4, 4)])
def test_plan_partitions_memory_by_zero_stage(checkpoint, stage, weights, grads):
    """ZeRO's per-rank memory at sharding 4 in fp32 (psi parameters): stage1 4psi + 4psi + 8psi/4,
    stage2 4psi + 4psi/4 + 8psi/4, stage3 (4 + 4 + 8)psi/4; the tool prints the stage's plan."""
    (share,) = plan_layout(load_config(checkpoint), Layout(world_size=4, sharding_parallel_degree=4, sharding=stage,
                                                           device="gpu"))
    psi = share.parameters
    assert (share.weight_bytes, share.grad_bytes, share.optimizer_bytes) == \
        (-(-4 * psi // weights), -(-4 * psi // grads), 8 * psi // 4)
    tool = subprocess.run([sys.executable, str(TOOLS / "reshard.py"), "plan", "--checkpoint", str(checkpoint),
                           "--world_size", "4", "--sharding_parallel_degree", "4", "--sharding", stage],
                          capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0 and f"({stage})" in tool.stdout, tool.stderr[-1000:]


LLAMA_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 4096}


def test_the_save_plan_of_a_70b_llama_on_256_ranks_spreads_the_writing_evenly(tmp_path):
    config, layout = config_from_dict(LLAMA_70B), Layout(world_size=256, tensor_parallel_degree=8,
                                                          pipeline_parallel_degree=8, device="gpu")
    items = save_items(plan_of(config), layout)
    writes = assign_writers(items, layout.tp)
    assert set(writes.written) == set(layout.rank_slots()), "every rank of the job writes"
    parameters = sum(int(np.prod(row.shape)) for row in plan_of(config).values())
    assert sum(writes.written.values()) == parameters * 4 * 3 + len(plan_of(config)) * 8  # weights, 2 moments, pows
    balance = estimate_save(writes, layout.rank_slots(), disk_gbps=2, link_gbps=25).balance
    assert balance <= 1.1
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    tool = subprocess.run([sys.executable, str(TOOLS / "reshard.py"), "plan", "--config", str(tmp_path / "config.json"),
                           "--world_size", "256", "--tensor_parallel_degree", "8", "--pipeline_parallel_degree", "8",
                           "--disk_gbps", "2", "--link_gbps", "25"], capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stderr[-1000:]
    assert f"(max/mean {balance:.3f})" in tool.stdout and "predicted save time" in tool.stdout


def test_plan_refuses_an_invalid_layout(checkpoint):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by --tensor_parallel_degree 8"):
        plan_layout(load_config(checkpoint), Layout(world_size=8, tensor_parallel_degree=8, device="gpu"))
    with pytest.raises(LayoutError):
        Layout(world_size=6, tensor_parallel_degree=4, device="gpu")
    tool = subprocess.run([sys.executable, str(TOOLS / "reshard.py"), "plan", "--checkpoint", str(checkpoint),
                           "--world_size", "5", "--pipeline_parallel_degree", "5"], capture_output=True, text=True,
                          timeout=120)
    assert tool.returncode == 1 and "num_hidden_layers=4 is fewer than" in tool.stderr


def test_rechunk_keeps_every_tensor_and_verifies(checkpoint, tmp_path):
    target = rechunk(checkpoint, tmp_path / "small", max_shard_bytes=256 << 10)
    assert len(list(target.glob("model-*.safetensors"))) > 2
    assert verify_checkpoint(target, plan_of_folder) == []
    before, after = _tensors(checkpoint), _tensors(target)
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert np.array_equal(value, after[name]), name
    assert json.loads((target / "trainer_state.json").read_text())["step"] == 2


def test_hf_export_import_round_trip(checkpoint, tmp_path):
    exported = export_hf(checkpoint, tmp_path / "hf")
    hf_config = json.loads((exported / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["num_key_value_heads"] == 2
    hf = _tensors(exported)
    ours = {name: value for name, value in _tensors(checkpoint).items() if "/" not in name}
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == ours["llama.layers.0.self_attn.k_proj.weight"].shape[::-1]
    back = _tensors(import_hf(exported, tmp_path / "back"))
    assert back.keys() == ours.keys()
    for name, value in ours.items():
        assert np.array_equal(value, back[name]), name


def test_transformers_loads_the_export_with_our_logits(checkpoint, tmp_path):
    import paddle
    import torch
    import transformers

    from modeling.llama import LlamaForCausalLM

    exported = export_hf(checkpoint, tmp_path / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(exported)).eval()
    config = load_config(checkpoint)
    ours = LlamaForCausalLM(config)
    ours.set_state_dict({k: paddle.to_tensor(v) for k, v in _tensors(checkpoint).items() if "/" not in k})
    ours.eval()
    ids = np.random.default_rng(3).integers(0, config.vocab_size, size=(2, 16))
    with torch.no_grad():
        expected = theirs(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours(paddle.to_tensor(ids)).numpy(), expected, rtol=1e-4, atol=1e-4)


def test_verify_tool_passes_a_sound_checkpoint(checkpoint):
    tool = subprocess.run([sys.executable, str(TOOLS / "verify_checkpoint.py"), str(checkpoint)],
                          capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0 and "OK" in tool.stdout


def test_verify_names_weights_that_do_not_fit_config(checkpoint, tmp_path):
    import shutil

    copy = Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    problems = verify_checkpoint(copy, plan_of_folder)
    assert "llama.layers.0.mlp.up_proj.weight: shape [64, 128], config.json implies [64, 96]" in problems
    assert len(problems) == 3 * 4, "gate, up and down of each of the 4 layers, nothing else"


@pytest.mark.multiproc
def test_check_alignment_fails_a_tampered_layout(checkpoint, tmp_path):
    from paddle_pp.training.alignment import check_alignment

    tampered = check_alignment(checkpoint, ["--tensor_parallel_degree", "2", "--learning_rate", "0.01"], 2,
                               steps=3, work_dir=tmp_path / "tampered")
    assert not tampered.aligned and tampered.worst_tensor_rel > 1e-3
    assert tampered.worst_gradient_rel > 1e-3, "step 5's gradients follow step 4's larger update"


# (flags, rtol of the weights after 2 steps). One embedding element's gradient is a near-total
# cancellation (4.6e-8, 2.3e-7 of the tensor's largest); another reduction order (tp2 + SP's over tp;
# stage3's over the sharding group, on an AVX-512 EPYC) changes it by about 4e-3 relative, and Adam's
# normalisation (eps 1e-8) turns that into about 1e-6 of the weight: 1.16e-5 of its scale under
# tp2 + SP, 1.11e-5 under stage3 (2026-11-28). Gradients and losses are still held to 1e-5; the
# weights get 2e-5.
NEW_LAYOUTS = {
    "stage3": (["--sharding", "stage3", "--sharding_parallel_degree", "2", "--stage3_segment_size", "1024"], 2e-5),
    "tp2_sequence_parallel": (["--tensor_parallel_degree", "2", "--sequence_parallel"], 2e-5),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(NEW_LAYOUTS))
def test_check_alignment_passes_stage3_and_sequence_parallel(checkpoint, tmp_path, layout):
    """Under stage3 the gradients each update applies are flat slices: the alignment check gathers
    them (and the sliced weights) into single-card tensors and compares every one. Under sequence
    parallelism (tp2 + SP: tp2's checks and more) the norm weights' gradients are each rank's
    positions, summed over tp before the update."""
    from paddle_pp.training.alignment import check_alignment, plot_alignment

    flags, weight_rtol = NEW_LAYOUTS[layout]
    report = check_alignment(checkpoint, flags, 2, steps=2, work_dir=tmp_path / layout, rtol=weight_rtol)
    assert report.steps == [3, 4] and report.aligned, report.table()
    assert plot_alignment(report, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert len(report.tensor_diffs) == len(report.gradient_diffs) == len(plan_of(load_config(checkpoint)))
    assert report.worst_gradient_rel <= 1e-5
    np.testing.assert_allclose(report.layout_losses, report.single_losses, rtol=1e-5)


def _header_dtypes(folder: Path) -> set[str]:
    dtypes = set()
    for shard in folder.glob("*.safetensors"):
        (length,) = struct.unpack("<Q", shard.read_bytes()[:8])
        header = json.loads(shard.read_bytes()[8:8 + length])
        dtypes |= {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return dtypes


def test_bf16_weights_export_loads_in_ours_and_paddlenlp_within_bf16_rounding(checkpoint, tmp_path):
    """A weights-only bfloat16 copy: no optimizer or trainer state; its tensors are the fp32 ones
    rounded to nearest bfloat16; our model and PaddleNLP's give the same logits from it, and those
    differ from the fp32 model's only by that rounding."""
    import ml_dtypes
    import paddle
    import paddlenlp.transformers as nlp

    from modeling.llama import LlamaForCausalLM

    from parity import assert_same_logits

    tool = subprocess.run([sys.executable, str(TOOLS / "reshard.py"), "weights", str(checkpoint), str(tmp_path / "bf16"),
                           "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stderr[-2000:]
    out = tmp_path / "bf16"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json", "tokenizer.model"]
    assert _header_dtypes(out) == {"BF16"} and verify_checkpoint(out, plan_of_folder) == []
    fp32 = {name: value for name, value in _tensors(checkpoint).items() if "/" not in name}
    exported = _tensors(out)
    for name, value in fp32.items():
        assert np.array_equal(exported[name], value.astype(ml_dtypes.bfloat16).astype(np.float32)), name
    config = load_config(checkpoint)

    def model(state):
        built = LlamaForCausalLM(config)
        built.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
        return built.eval()

    theirs = nlp.LlamaForCausalLM.from_pretrained(str(out), dtype="float32")
    assert_same_logits(model(exported), theirs, config.vocab_size, seed=11, rtol=1e-5)
    ids = paddle.to_tensor(np.random.default_rng(11).integers(0, config.vocab_size, size=(2, 12)))
    rounded, exact = model(exported)(ids).numpy(), model(fp32)(ids).numpy()
    # every weight carries bfloat16's 2^-9 relative rounding; through 4 layers the logits stay within 2^-5 of their scale
    assert 0 < np.abs(rounded - exact).max() <= 2**-5 * np.abs(exact).max()


def test_transformers_export_in_bf16_writes_rounded_transposed_weights(checkpoint, tmp_path):
    import ml_dtypes

    exported = export_hf(checkpoint, tmp_path / "hf", dtype="bfloat16")
    assert _header_dtypes(exported) == {"BF16"}
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours, hf = _tensors(checkpoint), _tensors(exported)
    q = ours["llama.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(hf["model.layers.0.self_attn.q_proj.weight"],
                          q.T.astype(ml_dtypes.bfloat16).astype(np.float32))
