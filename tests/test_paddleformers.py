"""PaddleFormers 1.2 itself against this trainer (its Trainer, models and checkpoints run in the test:
tests/paddleformers_runs.py, `.venv/paddleformers`).

PaddleFormers trains its own LLaMA 6 steps on our trainer's samples in our trainer's order, with the
same AdamW, clipping and schedule, and saves at step 3 in each of its formats (flex, its default, and
its unified checkpoint). Both import bit for bit: every weight and Adam state equal to what its model
and optimizer held at step 3. This trainer continues PaddleFormers' own curve (steps 4-6, 1e-5) from
the flex import under tp2 x pp2 and from the unified one on one card; a PaddleFormers folder given to
`--resume_from_checkpoint` as it is gets the import command. Its `save_pretrained` folder starts this
trainer on its whole curve (its warmup modelled). The way back: the tp2 x pp2 run's step-5
checkpoint (weights in transformers' layout) written as a flex checkpoint is resumed by PaddleFormers'
own Trainer, whose step 6 is its uninterrupted run's (1e-5), and PaddleFormers' model loads that
checkpoint's weights folder with our logits (1e-5).

PaddleFormers' warmup multiplies the peak by step / warmup, ours by default (PaddleNLP's pretraining,
Megatron) by (step + 1) / warmup: `--warmup_from_zero`, which PaddleFormers' recipes set, is its way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddleformers_runs
import pytest
from conftest import IDS

from checkpoint.unified_io import UnifiedReader
from checkpoint.verify import verify_checkpoint
from modeling.registry import plan_of_folder
from paddle_pp.data.source import build_data, dataset_sizes, plan_data

from parity import our_logits
from runs import CORPUS, MODEL, PP2, REPO, SCRIPT, TOKENIZER, TP2, pretrain

pytestmark = pytest.mark.multiproc

STEPS, SAVED, OURS_SAVED = 6, 3, 5
TOL = 1e-5
# PaddleFormers' TrainingArguments for our trainer's defaults and the test model's batches (tests/runs.py MODEL):
# 8 samples a step as 4 micro-batches of 2, AdamW (decay on matrices: PaddleFormers leaves out names with "norm" or
# "bias"), global-norm clip 1.0, cosine to the minimum after 2 warmup steps.
HYPER = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "learning_rate": 3e-3, "min_lr": 3e-4,
         "lr_scheduler_type": "cosine", "warmup_steps": 2, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95,
         "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "seed": 42}
SCHEDULE = ("--max_steps", str(STEPS), "--warmup_steps", "2")
TOOL = REPO / "tools" / "reshard.py"


def _ours(theirs: str) -> str:
    """Our name of a PaddleFormers LLaMA tensor (PaddleNLP's `llama.` where transformers has `model.`)."""
    return "llama." + theirs.removeprefix("model.") if theirs.startswith("model.") else theirs


@pytest.fixture(scope="module")
def rows(data_cache, tmp_path_factory) -> Path:
    """The samples of our trainer's 6-step run of the test model, in its order."""
    plan = plan_data("", CORPUS, TOKENIZER, data_cache, "949,50,1", "mmap", 32, 42, dataset_sizes(8, STEPS, 0, 1), 4096)
    train, _ = build_data(plan)
    path = tmp_path_factory.mktemp("paddleformers_rows") / "rows.npy"
    np.save(path, np.stack([train[i] for i in range(8 * STEPS)]).astype(np.int64))
    return path


@pytest.fixture(scope="module")
def theirs(rows, tmp_path_factory) -> dict[str, Path]:
    """PaddleFormers' 6-step runs from one seeded model, saving at step 3 in each of its formats."""
    runs = {}
    for format in ("flex_checkpoint", "unified_checkpoint"):
        root = tmp_path_factory.mktemp(format)
        if runs:
            (root / "start").symlink_to(next(iter(runs.values())) / "start", target_is_directory=True)
        paddleformers_runs.run("train", root, rows, STEPS, SAVED, format, json.dumps(HYPER))
        runs[format] = root
    return runs


def _losses(root: Path, name: str = "losses.json") -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads((root / name).read_text()).items()}


@pytest.fixture(scope="module")
def imported(theirs, tmp_path_factory) -> dict[str, Path]:
    """Each step-3 checkpoint imported by `tools/reshard.py paddleformers` (flex with the start folder)."""
    folders = {}
    for format, root in theirs.items():
        target = tmp_path_factory.mktemp(f"imported_{format}") / "unified"
        model = ("--model", str(root / "start")) if format == "flex_checkpoint" else ()
        tool = subprocess.run([sys.executable, str(TOOL), "paddleformers", str(root / "run" / f"checkpoint-{SAVED}"),
                               str(target), *model], capture_output=True, text=True, timeout=300)
        assert tool.returncode == 0, tool.stderr[-2000:]
        folders[format] = target
    return folders


def test_both_formats_import_what_paddleformers_held_bit_for_bit(theirs, imported):
    """Both runs trained alike; each import holds every weight and AdamW state (moments and beta powers)
    PaddleFormers' model and optimizer held after step 3, bit for bit (the head in our [hidden, vocab]),
    with its step, samples and schedule, and verifies against its config (tp axes included)."""
    assert _losses(theirs["flex_checkpoint"]) == _losses(theirs["unified_checkpoint"])
    for format, folder in imported.items():
        held = np.load(theirs[format] / f"state-{SAVED}.npz")
        model, optimizer = UnifiedReader(folder, "model"), UnifiedReader(folder, "optimizer")
        assert len(held.files) == len(model.tensors) + len(optimizer.tensors) == 39 * 5, format
        for key in held.files:
            name, _, state = key.partition("/")
            ours = model.read(_ours(name)) if not state else optimizer.read(f"{_ours(name)}/{state}")
            expected = held[key].T if name == "lm_head.weight" and held[key].ndim == 2 else held[key]
            assert np.array_equal(ours, expected.reshape(ours.shape)), (format, key)
        state = json.loads((folder / "trainer_state.json").read_text())
        assert (state["step"], state["consumed_samples"], state["lr_scheduler"]["last_epoch"]) == (3, 24, 3), format
        assert verify_checkpoint(folder, plan_of_folder) == [], format


def _resume_one_card(folder: Path, data_cache: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *MODEL, *SCHEDULE, "--logging_steps", "1",
                           "--resume_from_checkpoint", str(folder), "--data_cache", str(data_cache), "--output_dir",
                           str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_one_card_continues_paddleformers_curve_and_its_own_folder_gets_the_import_command(theirs, imported,
                                                                                        data_cache, tmp_path):
    """The unified import resumed on one card trains PaddleFormers' steps 4-6 (1e-5); its checkpoint folder
    as it is is refused before training, naming `tools/reshard.py paddleformers`."""
    done = _resume_one_card(imported["unified_checkpoint"], data_cache, tmp_path / "resumed")
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    expected = _losses(theirs["unified_checkpoint"])
    np.testing.assert_allclose(losses, [expected[step] for step in range(SAVED + 1, STEPS + 1)], rtol=TOL)
    for format, root in theirs.items():
        refused = _resume_one_card(root / "run" / f"checkpoint-{SAVED}", data_cache, tmp_path / f"refused_{format}")
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert "a PaddleFormers" in refused.stderr and "tools/reshard.py paddleformers" in refused.stderr, format


def test_its_save_pretrained_folder_trains_here_on_its_curve_warming_up_as_it_does(theirs, data_cache, tmp_path):
    """The folder PaddleFormers' `save_pretrained` wrote (its config keys, transformers' layout) starts this
    trainer, which with PaddleFormers' warmup (`--warmup_from_zero`, what its recipes set) trains its six
    losses (1e-5), the two warmup steps included."""
    out = tmp_path / "from_start"
    done = subprocess.run([sys.executable, str(SCRIPT), *MODEL, *SCHEDULE, "--warmup_from_zero", "--logging_steps",
                           "1", "--model_name_or_path", str(theirs["flex_checkpoint"] / "start"), "--data_cache",
                           str(data_cache), "--output_dir", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == 0.0, "PaddleFormers' first step has no learning rate"
    expected = _losses(theirs["flex_checkpoint"])
    np.testing.assert_allclose([r["loss"] for r in records], [expected[s] for s in range(1, STEPS + 1)], rtol=TOL)


def test_tp2_pp2_continues_its_curve_and_paddleformers_resumes_and_loads_what_we_saved(theirs, imported, rows,
                                                                                      run_workers, data_cache,
                                                                                      tmp_path):
    """The flex import under tp2 x pp2: steps 4-6 on PaddleFormers' curve (1e-5), every rank starting
    from exactly the import. Its step-5 checkpoint (weights in transformers' layout) written back by
    `to-flex` is resumed by PaddleFormers' Trainer, whose step 6 equals its uninterrupted run's and
    ours (1e-5); PaddleFormers' AutoModelForCausalLM loads that checkpoint with our logits (1e-5)."""
    out = tmp_path / "tp2pp2"
    results = pretrain(run_workers, data_cache, out, 4, (*TP2, *PP2, *SCHEDULE, "--save_steps", str(OURS_SAVED),
                                                         "--save_to_hf", "--resume_from_checkpoint",
                                                         str(imported["flex_checkpoint"])), "tp2pp2")
    expected = _losses(theirs["flex_checkpoint"])
    assert all(result["resumed_exactly"] for result in results)
    np.testing.assert_allclose(results[0]["losses"], [expected[step] for step in range(SAVED + 1, STEPS + 1)],
                               rtol=TOL)
    saved = out / f"checkpoint-{OURS_SAVED}"
    tool = subprocess.run([sys.executable, str(TOOL), "to-flex", str(saved), str(tmp_path / "flex")],
                          capture_output=True, text=True, timeout=300)
    assert tool.returncode == 0, tool.stderr[-2000:]
    root = theirs["flex_checkpoint"]
    paddleformers_runs.run("resume", root, tmp_path / "flex", rows, STEPS, json.dumps(HYPER))
    resumed = _losses(root, "resumed.json")
    assert list(resumed) == [STEPS]
    np.testing.assert_allclose(resumed[STEPS], [expected[STEPS], results[0]["losses"][-1]], rtol=TOL)
    np.save(tmp_path / "ids.npy", IDS)
    paddleformers_runs.run("logits", saved, tmp_path / "ids.npy", tmp_path / "logits.npy")
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), our_logits(saved, IDS), rtol=TOL, atol=TOL)
