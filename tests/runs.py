"""The small pretraining run the trainer and checkpoint tests launch (run_pretrain.py itself), and
`Run`, the description of one launch that the session-shared `pretrain_run` fixture runs once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_pretrain.py"
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"
MODEL = ("--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--max_seq_length", "32", "--global_batch_size", "8",
         "--per_device_train_batch_size", "1", "--max_steps", "20", "--warmup_steps", "5", "--eval_steps", "10",
         "--eval_iters", "1", "--disable_progress_bar")
GPT = ("--model_type", "gpt", "--num_key_value_heads", "0")
TP2, PP2 = ("--tensor_parallel_degree", "2"), ("--pipeline_parallel_degree", "2")
SHARDING2 = ("--sharding_parallel_degree", "2", "--sharding", "stage1")
HALF = ("--exit_after_steps", "10", "--save_steps", "10")
RESUME_STEP = 10


@dataclass(frozen=True)
class Run:
    """One launch of run_pretrain.py on the test model: `nnodes` x `nproc` ranks with `flags`,
    resuming from the step-10 checkpoint of `resume_from` when given. Equal descriptions are one run."""

    tag: str
    nproc: int = 1
    flags: tuple[str, ...] = ()
    resume_from: Run | None = None
    nnodes: int = 1


SINGLE = Run("single")
# The 16-rank run both suites need: the trainer compares its 20 steps with single card, the
# checkpoint tests resume its step-10 checkpoint on one card.
FOUR_D_SAVING = Run("4d_saving", 16, TP2 + PP2 + SHARDING2 + ("--save_steps", str(RESUME_STEP)))


def pretrain(launch, data_cache: Path, out: Path, nproc: int, flags, tag: str, nnodes: int = 1) -> list[dict]:
    """Launch run_pretrain.py on nnodes x nproc ranks writing into `out`; per-rank results."""
    return launch(SCRIPT, nproc, [*MODEL, *flags, "--data_cache", data_cache, "--output_dir", out], timeout=400,
                  nnodes=nnodes, tag=tag)
