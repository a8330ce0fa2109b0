"""The small pretraining run the trainer and checkpoint tests launch (run_pretrain.py itself), and
`Run`, the description of one launch that the session-shared `pretrain_run` fixture runs once."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint.save_plan import save_items
from checkpoint.unified_io import UnifiedReader
from checkpoint.verify import verify_checkpoint
from checkpoint.writers import assign_writers
from modeling.registry import plan_of_folder
from paddle_pp.runtime.layout import Layout
from paddle_pp.training.arguments import parse_args

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_pretrain.py"
TRAINER = REPO / "tests" / "workers" / "pretrain_worker.py"  # run_pretrain.py writing per-rank results
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"
# Micro-batches of 2: a step of 8 sequences is 4 micro-batches on one card, fewer collectives a step than
# 8 of 1 (every tp all-reduce and pipeline hand-over is a gloo round trip, 3-4 ms on 2 shared cores).
# The blockwise core pinned: what runs at 1,024 tokens and more on CPU, under cp, and where flash cannot
# (at 32 tokens the CPU default is the dense core; `single_dense` compares the two).
MODEL = ("--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--max_seq_length", "32", "--global_batch_size", "8",
         "--per_device_train_batch_size", "2", "--max_steps", "20", "--warmup_steps", "5", "--eval_steps", "10",
         "--eval_iters", "1", "--disable_progress_bar", "--attention_core", "blockwise")
# Micro-batches of 1 where a data degree of 4 would leave each rank one micro-batch of 2 a step: the
# pipeline and the sharded gradient paths keep accumulating over two.
MICRO1 = ("--per_device_train_batch_size", "1")
# Micro-batches of 4 where the run's claim is its layout, not accumulation: 2 a step on one data rank, half
# the collectives of 4 of 2 (a tp or cp exchange is a gloo round trip of 4-6 ms across 4 ranks on 2 cores).
# The single-card reference keeps 4 micro-batches of 2: equal token counts make the step's mean the same.
MICRO4 = ("--per_device_train_batch_size", "4")
GPT = ("--model_type", "gpt", "--num_key_value_heads", "0")
TP2, PP2 = ("--tensor_parallel_degree", "2"), ("--pipeline_parallel_degree", "2")
SHARDING2 = ("--sharding_parallel_degree", "2", "--sharding", "stage1")
# The first 10 steps of the 20-step schedule, saved at step 10: a checkpoint's source, and the curve of a layout
# whose steps cost most (stage3, recompute, experts over cp or sharding; `assert_trains_like` compares the steps a
# run trained and the weights of its last save). They include the warm-up and the steps clipping cuts.
HALF = ("--exit_after_steps", "10", "--save_steps", "10")
RESUME_STEP = 10
# Steps a resumed run trains (11-14, `--exit_after_steps` in the fixture that launches it): a few optimizer
# steps from the checkpoint's weights and states show the curve continues (1e-5), at less than half the
# cost of the 10 the schedule has left
CONTINUED = 4


def continued(losses: list[float]) -> list[float]:
    """The uninterrupted run's losses over the steps a resumed run trains."""
    return losses[RESUME_STEP:RESUME_STEP + CONTINUED]


@dataclass(frozen=True)
class Run:
    """One launch of run_pretrain.py on the test model: `nnodes` x `nproc` ranks with `flags`,
    resuming from the step-10 checkpoint of `resume_from` when given. Equal descriptions are one run."""

    tag: str
    nproc: int = 1
    flags: tuple[str, ...] = ()
    resume_from: Run | None = None
    nnodes: int = 1


FINAL_STEP = 20
# The single-card LLaMA run: its 20 steps are every layout's reference, its step-10 save is where resumes
# from one card start, its final weights are the parity tests' (a save does not change what is trained).
SINGLE = Run("single", flags=("--save_steps", str(RESUME_STEP)))
SINGLE_GPT = Run("full_gpt", flags=GPT + ("--save_steps", str(RESUME_STEP)))
CP2 = ("--context_parallel_degree", "2")
# The context-parallel suite compares its 10 steps with single card; the trainer suite's 2-node launch with it.
CP2_PP2 = Run("cp2_pp2", 4, CP2 + PP2 + MICRO4 + HALF)
# Tied GPT (embedding and head on both stages), recomputing attention blocks: the context-parallel
# suite compares its 10 steps with single card, the checkpoint suite resumes its step-10 save on one card.
GPT_CP2_PP2 = Run("gpt_cp2_pp2_recompute", 4, GPT + CP2 + PP2 + MICRO4 + HALF + (
    "--recompute", "--recompute_granularity", "full_attn"))
# The 8-rank run both suites need (sharding2 stage1 x tp2 x pp2: tp pieces and stages over sharded data
# replicas; dp beside sharding is stage2's dp2 x sharding2 in tests/test_sharding_stages.py): the trainer
# compares its 10 steps with single card, the checkpoint tests resume its step-10 checkpoint on one card.
SHARDED_TP_PP_SAVING = Run("sharding2_tp2_pp2_saving", 8, TP2 + PP2 + SHARDING2 + HALF)
# tp2 x pp2 saving in the background at step 10: the trainer suite compares its 20 steps with single card
# (so saving in the background changes nothing trained), the checkpoint suite resumes its step-10 save.
DUALPIPEV = ("--pipeline_schedule", "DualPipeV")  # 4 micro-batches of 2 a step: 2 x pp, DualPipeV's least
TP2_PP2_DUALPIPEV = Run("tp2pp2_dualpipev", 4, TP2 + PP2 + DUALPIPEV + HALF)
TP2_PP2_SAVING = Run("tp2pp2_async_saving", 4, TP2 + PP2 + ("--async_save", "--save_steps", str(RESUME_STEP)))


def pretrain(launch, data_cache: Path, out: Path, nproc: int, flags, tag: str, nnodes: int = 1) -> list[dict]:
    """Launch run_pretrain.py on nnodes x nproc ranks writing into `out`; per-rank results."""
    return launch(TRAINER, nproc, [*MODEL, *flags, "--data_cache", data_cache, "--output_dir", out], timeout=400,
                  nnodes=nnodes, tag=tag)


def written_by_rank(folder: Path) -> tuple[dict[int, int], dict[tuple[str, str], int]]:
    """(bytes each rank wrote: its files but the TP pieces other ranks wrote in them, and its pieces
    in other ranks' files; the rank whose file holds each tensor), from a checkpoint's indexes."""
    written, writer = defaultdict(int), {}
    for kind in ("model", "optimizer"):
        index = json.loads((folder / f"{kind}.safetensors.index.json").read_text())
        for rank, nbytes in index["metadata"]["bytes_written"].items():
            written[int(rank)] += nbytes
        writer |= {(kind, name): index["metadata"]["files"][fname]["rank"] for name, fname in index["weight_map"].items()}
    return dict(written), writer


def planned_writers(folder: Path, flags, nproc: int) -> dict[tuple[str, str], int]:
    """The rank the planner (`tools/reshard.py plan`) predicts writes each tensor of a save of the
    test model under `flags`, from the checkpoint's config.json alone."""
    layout = Layout.from_args(parse_args([*MODEL, *flags]).layout, world_size=nproc, device="cpu")
    predicted = assign_writers(save_items(plan_of_folder(folder), layout), layout.tp).writer
    ranks = {slot: rank for rank, slot in enumerate(layout.rank_slots())}
    return {key: ranks[slot] for key, slot in predicted.items()}


def final_weight_drifts(pretrain_run, run: Run, reference: Run, skip: str = "\0",
                        step: int = FINAL_STEP) -> dict[str, float]:
    """Per tensor of the step-`step` checkpoints of `run` and `reference`: the difference's norm over
    the reference tensor's norm (elementwise rtol is meaningless for entries near zero). Names
    ending in `skip` are left out."""
    weights = []
    for description in (run, reference):
        _, out = pretrain_run(description)
        reader = UnifiedReader(out / f"checkpoint-{step}", "model")
        weights.append({name: reader.read(name) for name in reader.tensors})
    assert weights[0].keys() == weights[1].keys()
    return {name: float(np.linalg.norm(weights[0][name] - value) / np.linalg.norm(value))
            for name, value in weights[1].items() if not name.endswith(skip)}


def history(pretrain_run, run: Run) -> dict:
    """Rank 0's result of `run`, after checking every rank reports the same losses."""
    results, _ = pretrain_run(run)
    assert len({tuple(r["losses"]) for r in results}) == 1, f"{run.tag}: ranks report different losses"
    return results[0]


def assert_trains_like(pretrain_run, run: Run, reference: Run, rtol: float, skip: str = "\0",
                       weights_at: int | None = None) -> None:
    """`run`'s steps on `reference`'s: losses, evaluation, grad norms (with clipping active, so a
    norm summed over the wrong ranks changes the updates) and the weights of its last save (or of step
    `weights_at`) within `rtol`. A run stopped early (`HALF`) is compared over the steps it trained."""
    expected, result = history(pretrain_run, reference), history(pretrain_run, run)
    steps = len(result["losses"])
    np.testing.assert_allclose(result["losses"], expected["losses"][:steps], rtol=rtol)
    assert_same_evaluations(result, expected, rtol)
    assert max(expected["grad_norms"][:steps]) > 1.0
    np.testing.assert_allclose(result["grad_norms"], expected["grad_norms"][:steps], rtol=rtol)
    drifts = final_weight_drifts(pretrain_run, run, reference, skip, step=weights_at or steps // RESUME_STEP * RESUME_STEP)
    assert max(drifts.values()) < rtol, max(drifts.items(), key=lambda item: item[1])


def assert_same_evaluations(result: dict, expected: dict, rtol: float) -> None:
    """The evaluations both runs made (at step 10, and 20 unless one stopped early) are the same."""
    steps = result["eval_losses"].keys() & expected["eval_losses"].keys()
    assert steps, "the runs share no evaluation"
    for step in steps:
        np.testing.assert_allclose(result["eval_losses"][step], expected["eval_losses"][step], rtol=rtol,
                                   err_msg=f"evaluation at step {step}")


def assert_continues_single_card(pretrain_run, resumed: Run, rtol: float) -> None:
    """The steps `resumed` trains after step 10 on the uninterrupted single-card run's."""
    reference = history(pretrain_run, SINGLE)
    np.testing.assert_allclose(history(pretrain_run, resumed)["losses"], continued(reference["losses"]), rtol=rtol)


def assert_written_as_planned(pretrain_run, run: Run, step: int = RESUME_STEP) -> dict[int, int]:
    """`run`'s checkpoint of `step`: every rank writes a share, each tensor by the rank the planner
    predicts, and it verifies; returns the bytes each rank wrote."""
    _, out = pretrain_run(run)
    folder = out / f"checkpoint-{step}"
    written, writer = written_by_rank(folder)
    assert sorted(written) == list(range(run.nproc))
    assert writer == planned_writers(folder, run.flags, run.nproc)
    assert verify_checkpoint(folder, plan_of_folder) == []
    return written
