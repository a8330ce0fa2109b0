"""Expert parallelism on this CPU: one MoE model trained at ep1, ep2 and ep4, at tp2 x ep2 with and
without sequence parallelism, at cp2 x ep2 and at sharding2 (stage1) x ep4, side by side (the same 4
processes and global batch), the bytes the token exchange moves against the planner's formula, and
the planner's answer for Qwen3-30B-A3B on 64 GPUs.

1. run_pretrain.py on a small Qwen3-MoE (hidden 128, 2 layers, 8 experts, top-2, expert width 128) from
   a config-only folder, 4 processes, --steps steps of 16 sequences of --max_seq_length tokens, under
   each of `LAYOUTS` (--layouts picks some). Per run: tokens/s of the steps after the first, each rank's peak of
   Paddle's host allocator against the planner's weights + gradients + states, and per rank and
   step the rows its exchanges address to other ranks (what an all-to-all sends: bytes counted in
   `ExpertGroup.exchange_rows`) against `dispatch_bytes_per_step` (balanced routing; worst case),
   and what the CPU backend's padded all_gather receives instead.
2. Planner (tools/reshard.py plan's model, bf16, flash core, full recompute, 4096 tokens, micro-batch
   1 x 16 per step): Qwen3-30B-A3B on 64 ranks, with and without experts split: per-rank memory,
   dispatch bytes per step and the predicted save time.
Writes bench/results/expert_parallel.json.

  .venv/bin/python bench/expert_parallel.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from checkpoint.save_plan import estimate_save, save_items  # noqa: E402
from checkpoint.writers import assign_writers  # noqa: E402
from modeling.registry import config_from_dict, plan_of  # noqa: E402
from paddle_pp.planning.memory import dispatch_bytes_per_step, plan_layout  # noqa: E402
from paddle_pp.runtime.launch import launch  # noqa: E402
from paddle_pp.runtime.layout import Layout  # noqa: E402
from paddle_pp.training.run_plan import plan_for  # noqa: E402

MODEL = {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
         "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
         "router_aux_loss_coef": 0.001, "max_position_embeddings": 4096, "tie_word_embeddings": False}
QWEN3_30B_A3B = REPO / "bench" / "configs" / "qwen3_30b_a3b.json"
PROCESSES, GLOBAL_BATCH = 4, 16
# name -> layout flags of the 4 processes (dp fills the rest); under SP each tp rank dispatches its own positions,
# under cp each cp rank its own part of the sequences; sharding2 x ep4 spreads the experts across the sharding ranks
LAYOUTS = {"ep1": (), "ep2": ("--expert_parallel_degree", "2"), "ep4": ("--expert_parallel_degree", "4"),
           "tp2 x ep2": ("--tensor_parallel_degree", "2", "--expert_parallel_degree", "2"),
           "tp2 x ep2 + SP": ("--tensor_parallel_degree", "2", "--expert_parallel_degree", "2", "--sequence_parallel"),
           "cp2 x ep2": ("--context_parallel_degree", "2", "--expert_parallel_degree", "2"),
           "sharding2 x ep4": ("--sharding", "stage1", "--sharding_parallel_degree", "2", "--expert_parallel_degree", "4")}


def rank_worker(argv: list[str]) -> int:
    """One rank of a launched run: run_pretrain.py's main, counting what its expert exchanges address
    to other ranks and what the padded all_gather brings in, then its result."""
    from paddle.base import core

    from paddle_pp.runtime.experts import ExpertGroup
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import cli

    moved = {"all_to_all": 0, "gathered": 0}
    exchange_rows = ExpertGroup.exchange_rows

    def counting(self, rows, counts):
        row_bytes = int(rows[0].numel()) * rows.element_size() if rows.shape[0] else 0
        moved["all_to_all"] += (int(counts[self.rank].sum()) - int(counts[self.rank, self.rank])) * row_bytes
        moved["gathered"] += (self.degree - 1) * int(counts.sum(axis=1).max()) * row_bytes
        return exchange_rows(self, rows, counts)

    ExpertGroup.exchange_rows = counting

    def report(trainer, history: list[dict]) -> None:
        trained = [record for record in history if "loss" in record]
        write_result({"tokens_per_sec": [r["tokens_per_sec"] for r in trained],
                      "peak_host_bytes": int(core.host_memory_stat_peak_value("Allocated", 0)),
                      "all_to_all_bytes_per_step": moved["all_to_all"] / max(len(trained), 1),
                      "gathered_bytes_per_step": moved["gathered"] / max(len(trained), 1)})

    return cli.main(argv, None, report)


def trainer_runs(seq: int, steps: int, names: list[str]) -> dict:
    from paddle_pp.training.arguments import parse_args

    config = config_from_dict(dict(MODEL, max_position_embeddings=seq))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(MODEL, architectures=["Qwen3MoeForCausalLM"])))
        flags = ["--model_name_or_path", str(folder), "--tokenizer_dir", str(REPO / "data" / "tokenizer"),
                 "--continue_training", "false", "--max_seq_length", str(seq), "--per_device_train_batch_size", "1",
                 "--global_batch_size", str(GLOBAL_BATCH), "--max_steps", str(steps), "--warmup_steps", "1",
                 "--do_eval", "false", "--disable_progress_bar"]
        for index, name in enumerate(names):
            results = launch(Path(__file__), PROCESSES, ["--rank_worker", *flags, *LAYOUTS[name], "--data_cache",
                                                         f"{tmp}/cache", "--output_dir", f"{tmp}/run{index}"],
                             work_dir=Path(tmp) / f"job{index}", timeout=7200)
            layout = Layout.from_args(parse_args(list(LAYOUTS[name])).layout, world_size=PROCESSES, device="cpu")
            workload = plan_for(config, layout, "--per_device_train_batch_size", "1", "--max_seq_length", str(seq),
                                "--global_batch_size", str(GLOBAL_BATCH)).workload()
            balanced, worst = dispatch_bytes_per_step(config, layout, workload)
            share = plan_layout(config, layout)[0]
            row = {"tokens_per_sec": statistics.median(results[0]["tokens_per_sec"][1:]),
                   "peak_host_bytes_worst_rank": max(r["peak_host_bytes"] for r in results),
                   "planned_weights_grads_states_bytes": share.weight_bytes + share.grad_bytes + share.optimizer_bytes,
                   "all_to_all_bytes_per_step": [r["all_to_all_bytes_per_step"] for r in results],
                   "gathered_bytes_per_step": [r["gathered_bytes_per_step"] for r in results],
                   "formula_balanced_bytes": balanced, "formula_worst_bytes": worst}
            out[name] = row
            print(f"{name}: {row['tokens_per_sec']:.0f} tokens/s, peak {row['peak_host_bytes_worst_rank'] / 2**20:.0f} "
                  f"MiB per rank (planner: weights+grads+states {row['planned_weights_grads_states_bytes'] / 2**20:.1f} "
                  f"MiB), all-to-all {max(row['all_to_all_bytes_per_step']) / 2**20:.2f} MiB/step on the busiest rank "
                  f"(formula {balanced / 2**20:.2f} balanced, {worst / 2**20:.2f} worst), padded all_gather "
                  f"{max(row['gathered_bytes_per_step']) / 2**20:.2f} MiB", flush=True)
    base = out[names[0]]
    for row in out.values():
        row["speed_ratio"] = row["tokens_per_sec"] / base["tokens_per_sec"]
    return out


PLANNED = {  # 64 ranks: name -> Layout keywords
    "tp4 x pp4 x sharding4 (stage1), experts whole": dict(tensor_parallel_degree=4, pipeline_parallel_degree=4,
                                                           sharding_parallel_degree=4, sharding="stage1"),
    "pp4 x dp8 x sharding2 (stage1), ep8": dict(pipeline_parallel_degree=4, sharding_parallel_degree=2,
                                                 sharding="stage1", expert_parallel_degree=8),
    "pp4 x dp16, ep16": dict(pipeline_parallel_degree=4, expert_parallel_degree=16),
    "pp4 x sharding16 (stage1), ep16 across the sharding ranks": dict(
        pipeline_parallel_degree=4, sharding_parallel_degree=16, sharding="stage1", expert_parallel_degree=16),
    "tp2 x pp4 x dp8, ep8": dict(tensor_parallel_degree=2, pipeline_parallel_degree=4, expert_parallel_degree=8),
    "tp2 x pp4 x dp8 + SP, ep8": dict(tensor_parallel_degree=2, pipeline_parallel_degree=4, expert_parallel_degree=8,
                                      sequence_parallel=True),
}


def planner() -> dict:
    config = config_from_dict(json.loads(QWEN3_30B_A3B.read_text()))
    out = {}
    for name, degrees in PLANNED.items():
        layout = Layout(world_size=64, device="gpu", **degrees)
        workload = plan_for(config, layout, "--bf16", "--per_device_train_batch_size", "1", "--max_seq_length", "4096",
                            "--gradient_accumulation_steps", "16", "--recompute").workload()
        worst = max(plan_layout(config, layout, 2, workload), key=lambda share: share.total_bytes)
        writes = assign_writers(save_items(plan_of(config), layout, 2), layout.tp)
        save = estimate_save(writes, layout.rank_slots(), disk_gbps=2.0, link_gbps=25.0)
        balanced, most = dispatch_bytes_per_step(config, layout, workload, 2)
        row = {"layout": layout.describe(), "parameters_per_rank": worst.parameters,
               "weights_grads_states_gb": (worst.weight_bytes + worst.grad_bytes + worst.optimizer_bytes) / 1e9,
               "activations_gb": worst.activation_bytes / 1e9, "total_gb": worst.total_bytes / 1e9,
               "dispatch_gb_per_step": balanced / 1e9, "dispatch_worst_gb_per_step": most / 1e9,
               "save_gb": sum(writes.written.values()) / 1e9, "save_seconds": save.seconds}
        out[name] = row
        print(f"Qwen3-30B-A3B {name}: {row['parameters_per_rank'] / 1e9:.2f}B parameters/rank, "
              f"{row['weights_grads_states_gb']:.1f} GB weights+grads+states, {row['activations_gb']:.1f} GB activations, "
              f"{row['total_gb']:.1f} GB in all; dispatch {row['dispatch_gb_per_step']:.0f} GB/step "
              f"(worst {row['dispatch_worst_gb_per_step']:.0f}); save {row['save_gb']:.0f} GB in "
              f"{row['save_seconds']:.1f} s", flush=True)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--rank_worker"]:
        sys.exit(rank_worker(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "model": MODEL, "max_seq_length": args.max_seq_length,
           "processes": PROCESSES, "global_batch": GLOBAL_BATCH, "planner": planner(),
           "runs": trainer_runs(args.max_seq_length, args.steps, args.layouts)}
    write_report(REPO / "bench" / "results" / "expert_parallel.json", out)


if __name__ == "__main__":
    main()
