"""Context parallelism on this CPU: one long sequence trained at cp1, cp2 and cp4 side by side, the
bytes the ring sends against the planner's formula, and the planner's answer for Llama-3-8B at 32k
and 128k tokens on 64 GPUs.

1. run_pretrain.py on a small LLaMA (hidden 128, 2 layers, 4 heads sharing 2 kv heads, head_dim 32)
   at --max_seq_length tokens, one sequence per step, --steps steps, under cp1 (one process), cp2
   and cp4 (2 and 4 processes: cp4 oversubscribes a 2-core machine). Per run: tokens/s of the steps
   after the first (the whole job's), each rank's peak of Paddle's host allocator, and the bytes
   each rank's ring shifted per step (counted in `Ring.start_shift`) against `ring_bytes_per_step`.
2. Planner (tools/reshard.py plan's model, bf16 on GPU, flash core, with and without full
   recompute): Llama-3-8B on 64 ranks as tp8 + SP x cp x sharding (stage1 over what is left),
   micro-batch 1 and one micro-batch per step, at 32,768 and 131,072 tokens: per-rank decoder activations (the head's logits are
   not in the planner's model), total and ring bytes per step for cp 1, 2, 4, 8.
Writes bench/results/context_parallel.json.

  .venv/bin/python bench/context_parallel.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from modeling.registry import config_from_dict  # noqa: E402
from paddle_pp.planning.memory import plan_layout, ring_bytes_per_step  # noqa: E402
from paddle_pp.runtime.launch import launch  # noqa: E402
from paddle_pp.runtime.layout import Layout  # noqa: E402
from paddle_pp.training.run_plan import plan_for  # noqa: E402

MODEL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 131072, "rope_theta": 500000.0}


def rank_worker(argv: list[str]) -> int:
    """One rank of a launched run: run_pretrain.py's main, counting the bytes its ring sends, then
    its result (tokens/s per step, host allocator peak, ring bytes per step)."""
    from paddle.base import core

    from paddle_pp.runtime import ring
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import cli

    sent = {"bytes": 0}
    start_shift = ring.Ring.start_shift

    def counting_shift(self, tensors, stream="kv"):
        sent["bytes"] += sum(int(t.numel()) * t.element_size() for t in tensors)
        return start_shift(self, tensors, stream)

    ring.Ring.start_shift = counting_shift

    def report(trainer, history: list[dict]) -> None:
        trained = [record for record in history if "loss" in record]
        write_result({"tokens_per_sec": [r["tokens_per_sec"] for r in trained],
                      "peak_host_bytes": int(core.host_memory_stat_peak_value("Allocated", 0)),
                      "ring_bytes_per_step": sent["bytes"] / max(len(trained), 1)})

    return cli.main(argv, None, report)


def trainer_runs(seq: int, steps: int, degrees: list[int]) -> dict:
    flags = [f"--{key}={value}" for key, value in MODEL.items()]
    flags += ["--max_seq_length", str(seq), "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
              "--max_steps", str(steps), "--warmup_steps", "1", "--do_eval", "false", "--disable_progress_bar"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in degrees:
            results = launch(Path(__file__), cp, ["--rank_worker", *flags, "--context_parallel_degree", str(cp),
                                                  "--data_cache", f"{tmp}/cache", "--output_dir", f"{tmp}/cp{cp}"],
                             work_dir=Path(tmp) / f"job{cp}", timeout=7200)
            config = config_from_dict(dict(MODEL, vocab_size=4096, max_position_embeddings=seq))
            layout = Layout(world_size=cp, context_parallel_degree=cp)
            formula = ring_bytes_per_step(config, layout, plan_for(
                config, layout, "--per_device_train_batch_size", "1", "--max_seq_length", str(seq),
                "--gradient_accumulation_steps", "1").workload())
            out[f"cp{cp}"] = {"tokens_per_sec": statistics.median(results[0]["tokens_per_sec"][1:]),
                              "peak_host_bytes_worst_rank": max(r["peak_host_bytes"] for r in results),
                              "ring_bytes_per_step": max(r["ring_bytes_per_step"] for r in results),
                              "ring_bytes_formula": formula}
            row = out[f"cp{cp}"]
            print(f"cp{cp}: {row['tokens_per_sec']:.0f} tokens/s, peak {row['peak_host_bytes_worst_rank'] / 2**20:.0f} "
                  f"MiB per rank, ring {row['ring_bytes_per_step'] / 2**20:.1f} MiB/step (formula "
                  f"{formula / 2**20:.1f})", flush=True)
    base = out[f"cp{degrees[0]}"]
    for row in out.values():
        row["speed_ratio"] = row["tokens_per_sec"] / base["tokens_per_sec"]
        row["memory_ratio"] = row["peak_host_bytes_worst_rank"] / base["peak_host_bytes_worst_rank"]
    return out


def planner(degrees: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    config = config_from_dict(LLAMA3_8B)
    out = {}
    for seq, cp, recompute in itertools.product((32768, 131072), degrees, (False, True)):
        sharding = 64 // (8 * cp)
        layout = Layout(world_size=64, tensor_parallel_degree=8, context_parallel_degree=cp, sequence_parallel=True,
                        sharding_parallel_degree=sharding, sharding="stage1" if sharding > 1 else "", device="gpu")
        workload = plan_for(config, layout, "--bf16", "--per_device_train_batch_size", "1", "--max_seq_length", str(seq),
                            "--gradient_accumulation_steps", "1", f"--recompute={recompute}").workload()
        worst = max(plan_layout(config, layout, 2, workload), key=lambda share: share.total_bytes)
        row = {"layout": layout.describe(), "activations_gb": worst.activation_bytes / 1e9,
               "total_gb": worst.total_bytes / 1e9,
               "ring_gb_per_step": ring_bytes_per_step(config, layout, workload, 2) / 1e9}
        name = f"{seq} tokens, cp{cp}" + (", full recompute" if recompute else "")
        out[name] = row
        print(f"Llama-3-8B {name} ({row['layout']}): activations {row['activations_gb']:.1f} GB, total "
              f"{row['total_gb']:.1f} GB, ring {row['ring_gb_per_step']:.1f} GB/step", flush=True)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--rank_worker"]:
        sys.exit(rank_worker(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_seq_length", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "model": MODEL, "max_seq_length": args.max_seq_length,
           "planner": planner(), "runs": trainer_runs(args.max_seq_length, args.steps, args.degrees)}
    write_report(REPO / "bench" / "results" / "context_parallel.json", out)


if __name__ == "__main__":
    main()
