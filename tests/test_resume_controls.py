"""Resume controls of long runs (PaddleNLP's names): weights without optimizer and schedule,
without the data skip, skipped data intervals; and the replica check that guards every save."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_pp.data.sampler import SequentialBatches

from runs import MODEL, REPO, SCRIPT, TP2

GLOBAL_BATCH, MAX_STEPS = 8, 10  # as runs.MODEL and _run set them
SKIP = ["--skip_data_intervals", "[[4, 6]]"]


def _run(data_cache: Path, out: Path, *flags: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(script), *MODEL, "--warmup_steps", "2", "--max_steps", "10",
                           "--data_cache", str(data_cache), "--output_dir", str(out), *flags],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def skipping(data_cache, tmp_path_factory):
    """10 steps skipping steps 4-6 (saving every 3), and the same run stopped inside the interval
    at step 5 then resumed without the flag."""
    base = tmp_path_factory.mktemp("skipping")
    _run(data_cache, base / "full", *SKIP, "--save_steps", "3")
    _run(data_cache, base / "stopped", *SKIP, "--exit_after_steps", "5", "--save_steps", "5")
    _run(data_cache, base / "resumed", "--resume_from_checkpoint", str(base / "stopped" / "checkpoint-5"))
    return base


def test_skipped_steps_advance_but_their_batches_are_never_trained(skipping):
    records = _records(skipping / "full")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["step"] for r in records if r.get("skipped")] == [4, 5, 6]
    assert [r["consumed_samples"] for r in records] == [GLOBAL_BATCH * s for s in range(10)]
    sampler = SequentialBatches(GLOBAL_BATCH * MAX_STEPS, GLOBAL_BATCH)
    trained = {int(i) for r in records if "loss" in r for i in sampler.global_batch(r["consumed_samples"])}
    skipped = {int(i) for r in records if r.get("skipped") for i in sampler.global_batch(r["consumed_samples"])}
    assert len(skipped) == 3 * GLOBAL_BATCH and not trained & skipped


def test_a_resume_inside_the_interval_keeps_skipping_and_continues_exactly(skipping):
    state = json.loads((skipping / "stopped" / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["skip_data_intervals"] == [[4, 6]]
    resumed = _records(skipping / "resumed")
    assert [r["step"] for r in resumed if r.get("skipped")] == [6]
    full = {r["step"]: r["loss"] for r in _records(skipping / "full") if "loss" in r}
    assert {r["step"]: r["loss"] for r in resumed if "loss" in r} == {s: full[s] for s in (7, 8, 9, 10)}


def test_ignore_data_skip_restarts_the_data_but_not_the_step(skipping, data_cache, tmp_path):
    _run(data_cache, tmp_path / "out", "--resume_from_checkpoint", str(skipping / "full" / "checkpoint-9"),
         "--ignore_data_skip")
    (record,) = _records(tmp_path / "out")
    assert (record["step"], record["consumed_samples"]) == (10, 0)


@pytest.mark.parametrize("ignore", [True, False], ids=["ignore_load_lr_and_optim", "full_resume"])
def test_ignore_load_lr_and_optim_keeps_weights_and_position_with_a_fresh_optimizer(skipping, data_cache, tmp_path,
                                                                                      ignore):
    folder = skipping / "full" / "checkpoint-9"
    probe = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "resume_probe_worker.py"), *MODEL,
                            "--max_steps", "10", "--data_cache", str(data_cache), "--resume_from_checkpoint",
                            str(folder), "--output_dir", str(tmp_path), *(["--ignore_load_lr_and_optim"] if ignore else [])],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert (seen["step"], seen["consumed_samples"], seen["weights_equal_checkpoint"]) == (9, 9 * GLOBAL_BATCH, True)
    assert seen["states_equal_fresh"] is ignore and seen["states_equal_checkpoint"] is not ignore
    assert seen["schedule_step"] == (0 if ignore else 9)


@pytest.mark.multiproc
def test_a_drifted_replica_fails_the_save_naming_the_tensor(run_workers, data_cache, tmp_path):
    out = tmp_path / "out"
    results = run_workers("replica_drift_worker.py", 2, [*MODEL, *TP2, "--exit_after_steps", "1", "--data_cache",
                                                          data_cache, "--output_dir", out], timeout=300)
    for result in results:
        error = result["outcomes"]["error"]
        assert error and "llama.norm.weight: ranks [0] hold fingerprint" in error and "ranks [1] hold" in error, error
        assert "lm_head" not in error and "layers.0" not in error, "only the drifted tensor is named"
        assert result["written"]["error"] == [], "a failed check writes nothing"
        assert result["outcomes"]["warn"] is None and result["written"]["warn"] == ["checkpoint-1", "latest"]


def test_fingerprint_sees_any_changed_value_in_any_dtype_and_size():
    from checkpoint.replicas import fingerprint, replica_mismatches

    for values in (np.arange(7, dtype=np.float32), np.arange(12, dtype=np.float64).reshape(3, 4),
                   np.arange(5, dtype=np.uint16)):
        for position in range(values.size):
            changed = values.copy()
            changed.reshape(-1)[position] += 1
            assert fingerprint(changed) != fingerprint(values), (values.dtype, position)
    reports = [{"w": (None, 1), "v": ("tp piece 0", 5)}, {"w": (None, 1), "v": ("tp piece 1", 6)},
               {"w": (None, 2), "v": ("tp piece 0", 5)}]
    assert replica_mismatches(reports) == ["w: ranks [0, 1] hold fingerprint 0000000000000001 vs ranks [2] hold "
                                           "fingerprint 0000000000000002"]
