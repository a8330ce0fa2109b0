"""Unified checkpoint: resume across layouts, crash safety, integrity, interoperability.

Resume matrix: 10 steps under layout A, save, 4 more under layout B; steps 11-14 equal an
uninterrupted single-card run within 1e-5 (fp32). Same-layout resume is bitwise equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from checkpoint.commit import latest_checkpoint, rotate
from checkpoint.format import FORMAT_VERSION, CheckpointError
from checkpoint.load import checking_ranks
from checkpoint.shards import ShardReader
from checkpoint.verify import verify_checkpoint
from modeling.registry import plan_of_folder
from paddle_pp.runtime.launch import LaunchError

from parity import assert_same_logits
from runs import (
    DUALPIPEV,
    GPT,
    GPT_CP2_PP2,
    HALF,
    MODEL,
    PP2,
    REPO,
    RESUME_STEP,
    SCRIPT,
    SHARDED_TP_PP_SAVING,
    SINGLE,
    SINGLE_GPT,
    TP2,
    TP2_PP2_DUALPIPEV,
    TP2_PP2_SAVING,
    Run,
    assert_trains_like,
    continued,
    planned_writers,
    pretrain,
    written_by_rank,
)

RESUME_TOL = 1e-5
LAYOUTS = {  # name: (nproc, flags)
    "single": (1, ()),
    "sharding2_tp2_pp2": (SHARDED_TP_PP_SAVING.nproc, SHARDED_TP_PP_SAVING.flags),
    "tp2pp2": (TP2_PP2_SAVING.nproc, TP2_PP2_SAVING.flags),  # TP pieces written in place from host copies, in the background
    "pp2_vpp2": (2, PP2 + ("--virtual_pp_degree", "2")),
    "dp2": (2, ()),
    "tp2pp2_dualpipev": (TP2_PP2_DUALPIPEV.nproc, TP2 + PP2 + DUALPIPEV),
}
# single -> a multi-axis layout: tests/test_context_parallel.py (cp2 x pp2), tests/test_sequence_parallel.py;
# more multi-axis -> single: tests/test_moe_runs.py (experts over ep), tests/test_family_training.py
# Across schedules: DualPipeV's V (the head on the first stage) saved and read by the interleaved
# schedule, and a one-card save read into the V.
# Into stage1's partitions: tests/test_moe_runs.py (dp2 x pp2 x ep2 saved, ep4 x sharding2 stage1 read); stage1's
# saved and read under stage3: tests/test_sharding_stages.py.
MATRIX = [("sharding2_tp2_pp2", "single"), ("tp2pp2_dualpipev", "pp2_vpp2"),
          ("single", "tp2pp2_dualpipev")]


def full(model: str) -> Run:
    """20 uninterrupted steps on one card (LLaMA's is the trainer suite's single-card run)."""
    return SINGLE if model == "llama" else SINGLE_GPT


def first(model: str, layout: str) -> Run:
    """10 steps under `layout` and a save; for LLaMA on one card, under sharding2 x tp2 x pp2, tp2 x pp2 and DualPipeV,
    the trainer suite's runs, which save at step 10 too."""
    shared = {"sharding2_tp2_pp2": SHARDED_TP_PP_SAVING, "tp2pp2": TP2_PP2_SAVING, "single": SINGLE, "tp2pp2_dualpipev": TP2_PP2_DUALPIPEV}
    if model == "llama" and layout in shared:
        return shared[layout]
    nproc, flags = LAYOUTS[layout]
    return Run(f"first_{model}_{layout}", nproc, (GPT if model == "gpt" else ()) + flags + HALF)


def resumed(model: str, saved_as: str, resumed_as: str) -> Run:
    """Steps 11-14 under `resumed_as` from the step-10 checkpoint saved under `saved_as`."""
    nproc, flags = LAYOUTS[resumed_as]
    return Run(f"resumed_{model}_{saved_as}_{resumed_as}", nproc, (GPT if model == "gpt" else ()) + flags,
               resume_from=first(model, saved_as))


@pytest.mark.multiproc
@pytest.mark.parametrize("saved_as, resumed_as", MATRIX, ids=[f"{a}->{b}" for a, b in MATRIX])
def test_resume_under_another_layout_continues_the_single_card_run(pretrain_run, saved_as, resumed_as):
    (reference, *_), _ = pretrain_run(full("llama"))
    results, _ = pretrain_run(resumed("llama", saved_as, resumed_as))
    np.testing.assert_allclose(results[0]["losses"], continued(reference["losses"]), rtol=RESUME_TOL)


@pytest.mark.multiproc
def test_dualpipev_trains_on_the_single_card_curve(pretrain_run):
    """Paddle's DualPipeVParallel under tp2 x pp2, 10 steps and the evaluation at step 10 (its forward-only
    pass): losses, evaluation, grad norms and step-10 weights within 1e-4."""
    assert_trains_like(pretrain_run, TP2_PP2_DUALPIPEV, SINGLE, rtol=1e-4)


@pytest.mark.multiproc
def test_tied_gpt_saved_from_pp2_resumes_on_one_card(pretrain_run):
    """The tied embedding and head, held by both stages of cp2 x pp2, are saved once and resume on one card."""
    (reference, *_), _ = pretrain_run(full("gpt"))
    (result, *_), _ = pretrain_run(Run("resumed_gpt_cp2_pp2_single", 1, GPT, resume_from=GPT_CP2_PP2))
    np.testing.assert_allclose(result["losses"], continued(reference["losses"]), rtol=RESUME_TOL)
    index = json.loads((pretrain_run(GPT_CP2_PP2)[1] / "checkpoint-10" / "model.safetensors.index.json").read_text())
    assert "gpt.embeddings.word_embeddings.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["tied"] == [["gpt.embeddings.word_embeddings.weight", "lm_head.weight"]]


@pytest.mark.multiproc
def test_same_layout_resume_is_bitwise_equal(pretrain_run):
    (reference, *_), _ = pretrain_run(full("llama"))
    (result, *_), _ = pretrain_run(resumed("llama", "single", "single"))
    assert result["losses"] == continued(reference["losses"])


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["dp2", "sharding2_tp2_pp2"])  # tp pieces over data replicas; also ep2's in tests/test_moe_runs.py
def test_every_rank_writes_a_share_balanced_by_bytes_as_the_planner_predicts(pretrain_run, layout):
    _, out = pretrain_run(first("llama", layout))
    folder = out / f"checkpoint-{RESUME_STEP}"
    written, writer = written_by_rank(folder)
    nproc, flags = LAYOUTS[layout]
    assert sorted(written) == list(range(nproc)), "every rank, data replicas included, writes"
    mean = np.mean(list(written.values()))
    if layout == "sharding2_tp2_pp2":  # 8 ranks share 8 MB holding six 1 MB tensors: a tensor is never split, so LPT's bound
        tensors = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["tensors"].values()
        largest = max(int(np.prod(meta["shape"])) * 4 for meta in tensors)
        assert max(written.values()) <= mean + largest
    else:
        assert max(written.values()) <= 1.25 * mean
    assert verify_checkpoint(folder, plan_of_folder) == []
    assert writer == planned_writers(folder, flags, nproc)


@pytest.mark.multiproc
def test_index_records_layout_checksums_and_split_axes(pretrain_run):
    _, out = pretrain_run(SHARDED_TP_PP_SAVING)
    folder = out / "checkpoint-10"
    assert latest_checkpoint(out) == folder  # the run stops at its step-10 save
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    meta = index["metadata"]
    assert meta["saving_layout"]["world_size"] == 8 and meta["format_version"] == FORMAT_VERSION
    assert set(meta["files"]) == set(index["weight_map"].values())
    assert meta["tensors"]["llama.layers.0.self_attn.q_proj.weight"]["tp_axis"] == 1
    assert meta["tensors"]["llama.layers.0.self_attn.o_proj.weight"]["tp_axis"] == 0
    assert meta["tensors"]["llama.norm.weight"]["tp_axis"] is None
    optimizer = json.loads((folder / "optimizer.safetensors.index.json").read_text())
    assert {k.split("/")[1] for k in optimizer["weight_map"]} == {"moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"}
    assert len(meta["files"]) > 1, "the 8-rank save must spread its writing over several ranks"
    assert verify_checkpoint(folder, plan_of_folder) == []


@pytest.mark.multiproc
def test_paddlenlp_from_pretrained_gives_our_logits(pretrain_run):
    import paddlenlp.transformers as nlp

    from modeling.llama import LlamaConfig, LlamaForCausalLM

    folder = pretrain_run(first("llama", "tp2pp2"))[1] / "checkpoint-10"
    theirs = nlp.LlamaForCausalLM.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    ours = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    state = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        reader = ShardReader(shard)
        state |= {name: paddle.to_tensor(reader.read(name)) for name in reader.names}
    missing, unexpected = ours.set_state_dict(state)
    assert not missing and not unexpected
    assert_same_logits(ours, theirs, config["vocab_size"], seed=5)


@pytest.mark.multiproc
def test_corrupt_file_is_checked_by_one_rank_and_fails_every_rank(pretrain_run, run_workers, data_cache, tmp_path):
    """A tp2 resume reads every file on both ranks; one checks each file's CRC and the other's
    failure names it too, so nobody trains on (or waits for) a damaged checkpoint."""
    folder = _copy(pretrain_run(first("llama", "tp2pp2"))[1] / "checkpoint-10", tmp_path / "checkpoint-10")
    shard = max(folder.glob("model-*.safetensors"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(LaunchError) as error:
        pretrain(run_workers, data_cache, tmp_path / "out", 2, TP2 + ("--resume_from_checkpoint", folder), "corrupt")
    logs = [error.value.rank_logs[rank] for rank in (0, 1)]
    checked = [rank for rank, log in enumerate(logs) if f"{shard.name} fails its crc32 checksum" in log
               and "failed on rank" not in log]
    assert len(checked) == 1, [log[-1500:] for log in logs]
    assert f"failed on rank {checked[0]}" in logs[1 - checked[0]] and shard.name in logs[1 - checked[0]]


def test_each_file_is_checked_once_by_a_rank_that_reads_it_spread_by_bytes():
    stage0, stage1 = {"a": 400, "b": 300, "c": 100}, {"d": 200, "e": 200}
    by_rank = [stage0, stage0, stage1, stage1, stage0, stage0, stage1, stage1]  # tp2 pp2 dp2 (dp outermost)
    checker = checking_ranks(by_rank)
    assert set(checker) == set("abcde")
    assert all(name in by_rank[rank] for name, rank in checker.items())
    checked = [sum(size for name, size in files.items() if checker[name] == rank) for rank, files in enumerate(by_rank)]
    assert checked == [400, 300, 200, 200, 100, 0, 0, 0]
    assert checking_ranks([{"a": 10}, {}]) == {"a": 0} and checking_ranks([{}, {"a": 10}]) == {"a": 1}


def _single_card(tmp_path: Path, *flags: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script), *MODEL, "--warmup_steps", "2", "--data_cache", str(tmp_path / "cache"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "out"
    short = ["--max_steps", "4", "--save_steps", "2", "--output_dir", str(out)]
    killed = _single_card(tmp_path, *short, script=REPO / "tests" / "workers" / "killed_save_worker.py")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert (out / ".tmp-checkpoint-4").is_dir() and not (out / "checkpoint-4").exists()
    with pytest.warns(UserWarning, match="never committed"):
        assert latest_checkpoint(out) == out / "checkpoint-2"
    resumed = _single_card(tmp_path, *short, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    reference = _single_card(tmp_path, "--max_steps", "4", "--output_dir", str(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], "the resumed run supersedes the killed run's records of steps 3-4"
    assert _losses(out)[-2:] == _losses(tmp_path / "ref")[2:], "resumed steps 3-4 must equal the uninterrupted run"
    assert (out / "latest").read_text().strip() == "checkpoint-4"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-card run saving at step 3, synchronously and asynchronously (two output dirs)."""
    base = tmp_path_factory.mktemp("saved")
    for name, extra in (("sync", []), ("async", ["--async_save"])):
        done = _single_card(base, "--max_steps", "3", "--save_steps", "3", "--output_dir", str(base / name), *extra)
        assert done.returncode == 0, done.stderr[-2000:]
    return base


def test_async_save_writes_the_same_bytes_as_sync(saved):
    sync, async_ = saved / "sync" / "checkpoint-3", saved / "async" / "checkpoint-3"
    shards = sorted(p.name for p in sync.glob("*.safetensors"))
    assert shards == sorted(p.name for p in async_.glob("*.safetensors")) and shards
    for name in shards:
        assert (sync / name).read_bytes() == (async_ / name).read_bytes(), name
    assert (async_ / ".." / "latest").read_text().strip() == "checkpoint-3"


def _copy(folder: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(folder, target)
    return target


def test_flipped_byte_fails_verification_and_resume_naming_the_file(saved, tmp_path):
    folder = _copy(saved / "sync" / "checkpoint-3", tmp_path / "checkpoint-3")
    shard = folder / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = verify_checkpoint(folder, plan_of_folder)
    assert len(problems) == 1 and shard.name in problems[0] and "crc32 checksum mismatch" in problems[0]
    tool = subprocess.run([sys.executable, str(REPO / "tools" / "verify_checkpoint.py"), str(folder)],
                          capture_output=True, text=True, timeout=60)
    assert tool.returncode == 1 and shard.name in tool.stdout
    resumed = _single_card(tmp_path, "--max_steps", "4", "--output_dir", str(tmp_path / "out"),
                           "--resume_from_checkpoint", str(folder))
    assert resumed.returncode == 2 and shard.name in resumed.stderr and "crc32 checksum" in resumed.stderr


V1 = REPO / "tests" / "data" / "checkpoint-v1"
V1_MODEL = ["--hidden_size", "8", "--intermediate_size", "16", "--num_hidden_layers", "2", "--num_attention_heads", "2",
            "--num_key_value_heads", "2"]


def test_stored_format_version_1_checkpoint_verifies_and_resumes(tmp_path):
    """A folder written in format version 1 (SHA-256 per file), stored in the repository: readers
    must keep verifying it (and catching damage) and resuming from it."""
    assert json.loads((V1 / "model.safetensors.index.json").read_text())["metadata"]["format_version"] == 1
    assert verify_checkpoint(V1, plan_of_folder) == []
    resumed = _single_card(tmp_path, *V1_MODEL, "--max_steps", "3", "--output_dir", str(tmp_path / "out"),
                           "--resume_from_checkpoint", str(V1))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [3]
    folder = _copy(V1, tmp_path / "damaged")
    shard = folder / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    assert [p for p in verify_checkpoint(folder, plan_of_folder) if "sha256 checksum mismatch" in p and shard.name in p]


def test_a_newer_format_version_is_refused_naming_both_versions(tmp_path):
    folder = _copy(V1, tmp_path / "future")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["metadata"]["format_version"] = FORMAT_VERSION + 1
    index_file.write_text(json.dumps(index))
    resumed = _single_card(tmp_path, *V1_MODEL, "--max_steps", "3", "--output_dir", str(tmp_path / "out"),
                           "--resume_from_checkpoint", str(folder))
    assert resumed.returncode == 2
    assert f"format version {FORMAT_VERSION + 1}, newer than this reader's {FORMAT_VERSION}" in resumed.stderr


def test_truncated_shard_fails_clearly(saved, tmp_path):
    folder = _copy(saved / "sync" / "checkpoint-3", tmp_path / "checkpoint-3")
    shard = folder / "optimizer-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert any("truncated" in p and shard.name in p for p in verify_checkpoint(folder, plan_of_folder))
    with pytest.raises(CheckpointError, match="truncated|not a readable"):
        ShardReader(shard)


def test_checkpoint_of_another_model_fails_before_training(saved, tmp_path):
    resumed = _single_card(tmp_path, "--hidden_size", "32", "--output_dir", str(tmp_path / "out"),
                           "--resume_from_checkpoint", str(saved / "sync" / "checkpoint-3"))
    assert resumed.returncode == 2
    assert "hidden_size is 64 there and 32 here" in resumed.stderr


def test_rotation_never_deletes_the_latest(tmp_path):
    from checkpoint.commit import commit, temp_dir

    for step in (1, 2, 3):
        temp_dir(tmp_path, step).mkdir()
        commit(tmp_path, step)
    (tmp_path / "latest").write_text("checkpoint-1\n")  # e.g. a resume pointed latest at an older one
    removed = rotate(tmp_path, keep=1)
    assert sorted(p.name for p in removed) == ["checkpoint-2"]
    assert (tmp_path / "checkpoint-1").is_dir() and (tmp_path / "checkpoint-3").is_dir()
