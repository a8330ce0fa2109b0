"""reshard split / join / merge / paddleformers on checkpoints real runs wrote, and the trainer loading a split copy.

The fleet files come from a real tp2pp2 run that saves them as PaddleNLP's trainer does without
unified checkpoint, and as PaddleFormers' trainer does by default (a flex checkpoint through Paddle's
own save_state_dict, every rank its pieces). Resumes are compared with the original run's next step:
a merge must lose nothing (rtol 1e-5 across layouts), a flex import holds what the merge holds bit
for bit, and a pre-split copy holds fleet's per-rank tensors bit for bit and gives every rank exactly
its file's weights and Adam states.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import paddle
import pytest

from checkpoint.format import CheckpointError
from checkpoint.shards import ShardReader
from checkpoint.split import join_split, rank_file, split_checkpoint
from checkpoint.unified_io import UnifiedReader
from checkpoint.verify import verify_checkpoint
from modeling.registry import plan_of_folder
from paddle_pp.interop.fleet import merge_fleet
from paddle_pp.runtime.layout import Layout

from runs import MODEL, PP2, REPO, SCRIPT, TP2, TRAINER

RESUME_TOL = 1e-5
TOOL = REPO / "tools" / "reshard.py"
TP2PP2 = Layout(world_size=4, tensor_parallel_degree=2, pipeline_parallel_degree=2)
TP4 = Layout(world_size=4, tensor_parallel_degree=4)


@pytest.fixture(scope="module")
def fleet(run_workers_module, data_cache, tmp_path_factory):
    """A tp2pp2 run's per-rank fleet files after step 3, and the loss of its step 4."""
    base = tmp_path_factory.mktemp("fleet")
    results = run_workers_module("fleet_save_worker.py", 4, [
        str(base / "fleet"), *MODEL, *TP2, *PP2, "--exit_after_steps", "3", "--data_cache", str(data_cache),
        "--output_dir", str(base / "run")], timeout=300, tag="fleet_save")
    assert len({r["next_loss"] for r in results}) == 1, "every rank reports the global loss"
    return base / "fleet", results[0]["next_loss"]


@pytest.fixture(scope="module")
def merged(fleet, tmp_path_factory):
    folder, _ = fleet
    target = tmp_path_factory.mktemp("merged") / "unified"
    tool = subprocess.run([sys.executable, str(TOOL), "merge", str(folder), str(target)], capture_output=True,
                          text=True, timeout=300)
    assert tool.returncode == 0, tool.stderr[-2000:]
    return target


@pytest.fixture(scope="module")
def imported(fleet, merged, tmp_path_factory):
    """The run's flex checkpoint imported by the tool, the model's config taken from a folder holding it
    (a run from random weights has no model folder: the merge's checkpoint stands in)."""
    folder, _ = fleet
    target = tmp_path_factory.mktemp("imported") / "unified"
    tool = subprocess.run([sys.executable, str(TOOL), "paddleformers", str(folder / "flex"), str(target), "--model", str(merged)],
                          capture_output=True, text=True, timeout=300)
    assert tool.returncode == 0, tool.stderr[-2000:]
    return target


def _resume(tmp_path, data_cache, folder, nproc_flags=(), steps=1) -> list[float]:
    out = tmp_path / f"resumed_{folder.name}"
    done = subprocess.run([sys.executable, str(SCRIPT), *MODEL, *nproc_flags, "--exit_after_steps", str(steps),
                           "--logging_steps", "1", "--resume_from_checkpoint", str(folder), "--data_cache",
                           str(data_cache), "--output_dir", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
def test_merged_fleet_files_resume_on_one_card_with_the_next_loss(fleet, merged, tmp_path, data_cache):
    _, next_loss = fleet
    assert verify_checkpoint(merged, plan_of_folder) == []
    state = json.loads((merged / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["consumed_samples"] == 24 and state["lr_scheduler"]["last_epoch"] == 3
    optimizer = UnifiedReader(merged, "optimizer").tensors
    assert optimizer["llama.layers.0.mlp.down_proj.weight/moment2"]["shape"] == [128, 64], "single-card shape"
    (loss,) = _resume(tmp_path, data_cache, merged)
    np.testing.assert_allclose(loss, next_loss, rtol=RESUME_TOL)


@pytest.mark.multiproc
def test_a_flex_checkpoint_of_tp2_pp2_pieces_imports_whole(fleet, merged, imported):
    """tp2 x pp2's flex pieces (heads transposed, stages apart) imported: every weight and Adam state
    equal bit for bit to the fleet merge's of the same run (which resumes at the run's step-4 loss
    above), step 3 and the schedule kept, the checkpoint verified. PaddleFormers' own flex and unified
    checkpoints, and PaddleFormers resuming ours: tests/test_paddleformers.py."""
    verified = subprocess.run([sys.executable, str(REPO / "tools" / "verify_checkpoint.py"), str(fleet[0] / "flex")],
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0 and "(flex checkpoint): OK" in verified.stdout, verified.stdout + verified.stderr
    assert verify_checkpoint(imported, plan_of_folder) == []
    state = json.loads((imported / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["consumed_samples"] == 24 and state["lr_scheduler"]["last_epoch"] == 3
    for kind in ("model", "optimizer"):
        ours, fleets = UnifiedReader(imported, kind), UnifiedReader(merged, kind)
        assert ours.tensors.keys() == fleets.tensors.keys(), kind
        for name in ours.tensors:
            assert np.array_equal(ours.read(name), fleets.read(name)), name


@pytest.mark.multiproc
def test_split_holds_exactly_each_fleet_rank_and_each_rank_loads_its_file_exactly(fleet, merged, tmp_path, run_workers, data_cache):
    fleet_folder, next_loss = fleet
    split = split_checkpoint(merged, tmp_path / "split", TP2PP2, plan_of_folder(merged))
    for tp_rank in range(2):
        for stage in range(2):
            theirs = paddle.load(str(fleet_folder / f"model_state.tp{tp_rank:02d}_pp{stage:02d}.pdparams"),
                                 return_numpy=True)
            ours = ShardReader(split / rank_file("model", tp_rank, stage))
            assert ours.names == set(theirs), (tp_rank, stage)
            for name in ours.names:
                assert np.array_equal(ours.read(name), theirs[name]), name
    results = run_workers(TRAINER, 4, [
        *MODEL, *TP2, *PP2, "--exit_after_steps", "1", "--resume_from_checkpoint", str(split), "--data_cache",
        str(data_cache), "--output_dir", str(tmp_path / "from_split")], timeout=300, tag="from_split")
    assert [r["resumed_exactly"] for r in results] == [True] * 4, "each rank holds exactly its rank file"
    np.testing.assert_allclose(results[0]["losses"][0], next_loss, rtol=RESUME_TOL)


@pytest.mark.parametrize("layout", [TP2PP2, TP4], ids=["tp2pp2", "tp4"])
def test_join_gives_back_the_unified_tensors_bit_for_bit(merged, tmp_path, layout):
    """Split for tp2 x pp2, or for tp4 where the model's 2 key/value heads are fewer than the ranks (each
    rank file holds the k/v projections and their states whole), and joined back: the same tensors."""
    split = split_checkpoint(merged, tmp_path / "split", layout, plan_of_folder(merged))
    joined = join_split(split, tmp_path / "joined")
    assert verify_checkpoint(joined, plan_of_folder) == []
    for kind in ("model", "optimizer"):
        before, after = UnifiedReader(merged, kind), UnifiedReader(joined, kind)
        assert before.tensors.keys() == after.tensors.keys()
        for name in before.tensors:
            assert np.array_equal(before.read(name), after.read(name)), name
        last = ShardReader(split / rank_file(kind, layout.tp - 1, layout.pp - 1))
        projections = [name for name in last.names if "v_proj.weight" in name]
        assert projections, kind
        for name in projections:
            whole = layout.tp > 2  # 2 kv heads: split over tp2, each of 4 ranks holds them whole
            expected = before.read(name) if whole else before.read(name, before.piece(name, layout.tp, layout.tp - 1))
            assert np.array_equal(last.read(name), expected), name


def test_split_copy_under_another_layout_fails_before_training(merged, tmp_path, data_cache):
    split = split_checkpoint(merged, tmp_path / "split", TP2PP2, plan_of_folder(merged))
    done = subprocess.run([sys.executable, str(SCRIPT), *MODEL, "--resume_from_checkpoint", str(split),
                           "--data_cache", str(data_cache), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "pre-split for tp2 pp2 vpp1, this run is tp1 pp1" in done.stderr


def test_merge_refuses_an_incomplete_fleet_checkpoint(fleet, tmp_path):
    folder, _ = fleet
    partial = tmp_path / "partial"
    partial.mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.name != "model_state.tp01_pp01.pdparams":
            (partial / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"lacks model_state files for ranks \['tp01_pp01'\]"):
        merge_fleet(partial, tmp_path / "out")
    assert not (tmp_path / "out").exists()
