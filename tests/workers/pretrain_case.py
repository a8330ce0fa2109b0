"""The small pretraining run the trainer and checkpoint tests launch, through run_pretrain.py itself."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "run_pretrain.py"
CORPUS, TOKENIZER = REPO / "data" / "jargon-4.4.7.txt", REPO / "data" / "tokenizer"
MODEL = ["--hidden_size", "64", "--intermediate_size", "128", "--num_hidden_layers", "4", "--num_attention_heads", "4",
         "--num_key_value_heads", "2", "--max_seq_length", "32", "--global_batch_size", "8",
         "--per_device_train_batch_size", "1", "--max_steps", "20", "--warmup_steps", "5", "--eval_steps", "10",
         "--eval_iters", "1", "--eval_samples", "16", "--disable_progress_bar"]
TP2, PP2 = ["--tensor_parallel_degree", "2"], ["--pipeline_parallel_degree", "2"]
SHARDING2 = ["--sharding_parallel_degree", "2", "--sharding", "stage1"]


def pretrain(run, data_cache: Path, out: Path, nproc: int, flags: list, tag: str, nnodes: int = 1) -> list[dict]:
    """Launch run_pretrain.py on nnodes x nproc ranks writing into `out`; per-rank results."""
    return run(SCRIPT, nproc, [*MODEL, *flags, "--data_cache", data_cache, "--output_dir", out], timeout=400,
               nnodes=nnodes, tag=tag)

# The 16-rank run both suites need: the trainer compares its 20 steps with single card, the
# checkpoint tests resume its step-10 checkpoint on one card.
FOUR_D_SAVING = ("4d_saving", 16, tuple(TP2 + PP2 + SHARDING2 + ["--save_steps", "10"]))
