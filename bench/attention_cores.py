"""The attention cores at real lengths: what each keeps and costs, measured side by side on this CPU,
and what the planner says for PaddleNLP's recipe shapes before (dense) and after (flash).

1. Core alone, forward + backward, one process per (core, length) so peaks do not mix: time and
   peak allocator bytes (Paddle's CPU statistic, above the inputs) at 512-16k tokens, [1, seq, 9
   heads (3 kv), 64] (SmolLM-135M's heads); the dense core is skipped where its peak by its own
   model (what it keeps, and the scores and probabilities its backward makes alongside: 3x) passes
   --max_gb, and the length is named; a run the kernel kills (out of memory) is recorded as such.
2. Planner (tools/reshard.py plan's model, bf16 on GPU): per-rank activations and totals of
   Llama-2-7B at tp2 x pp4 + SP and of PaddleNLP's llama recipe shape (Llama-3-8B, tp2, sharding
   stage2), 4096 tokens, micro-batch 1, with the dense core (before) and the flash core (after).
3. run_pretrain.py at SmolLM-135M's shape, one process, tokens/s of the steps after the first with
   each core pinned (--attention_core) at 1024 and 4096 tokens (the dense core skipped where its
   model passes --max_gb).
The crossover of part 1 is the CPU's choice between the two (`CPU_DENSE_BELOW` in
modeling/attention_core/__init__.py); the CPU model is recorded with the results.
Writes bench/results/attention_cores.json.

  .venv/bin/python bench/attention_cores.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from modeling.attention_core import CORES, Heads  # noqa: E402
from modeling.registry import config_from_dict  # noqa: E402
from paddle_pp.planning.memory import plan_layout  # noqa: E402
from paddle_pp.runtime.layout import Layout  # noqa: E402
from paddle_pp.training.report import read_metrics  # noqa: E402
from paddle_pp.training.run_plan import plan_for  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPE = Heads(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM)
PEAK_OVER_KEPT = 3  # the dense core's measured peak over what it keeps: 2.4x at 1k-8k tokens
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096}
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rope_theta": 500000.0}
SMOLLM_135M = ["--hidden_size", "576", "--intermediate_size", "1536", "--num_hidden_layers", "30",
               "--num_attention_heads", "9", "--num_key_value_heads", "3", "--tie_word_embeddings"]
CORE_RUN = """
import json, sys, time
import paddle
from modeling.attention_core import CORES
from paddle_pp.training.activations import host_allocated
from paddle.base import core
name, seq = sys.argv[1], int(sys.argv[2])
q, k, v = (paddle.randn([1, seq, n, {head_dim}]) for n in ({heads}, {kv}, {kv}))
for t in (q, k, v):
    t.stop_gradient = False
upstream = paddle.randn([1, seq, {heads} * {head_dim}])
times = []
for repeat in range(3):
    start = host_allocated()
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    began = time.perf_counter()
    (CORES[name](q, k, v, False) * upstream).sum().backward()
    times.append(time.perf_counter() - began)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - start
print(json.dumps({{"seconds": min(times), "peak_bytes": peak}}))
""".format(heads=HEADS, kv=KV_HEADS, head_dim=HEAD_DIM)


def core_runs(lengths: list[int], max_gb: float) -> dict:
    out: dict[str, dict] = {}
    for name in ("dense", "blockwise"):
        out[name] = {}
        for seq in lengths:
            kept = CORES[name].saved_bytes(1, seq, SHAPE, 4, False)
            if PEAK_OVER_KEPT * kept > max_gb * 2**30:
                out[name][seq] = {"skipped": f"keeps {kept / 2**30:.1f} GiB by its model, peaks near "
                                             f"{PEAK_OVER_KEPT * kept / 2**30:.0f} (over --max_gb {max_gb})"}
                print(f"{name:>9} {seq:>6}: skipped, {out[name][seq]['skipped']}", flush=True)
                continue
            done = subprocess.run([sys.executable, "-c", CORE_RUN, name, str(seq)], capture_output=True, text=True,
                                  cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}, timeout=3600)
            if done.returncode:
                out[name][seq] = {"failed": f"exit status {done.returncode} (a negative one: killed by that signal)"}
                print(f"{name:>9} {seq:>6}: {out[name][seq]['failed']}", flush=True)
                continue
            out[name][seq] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:>9} {seq:>6}: {out[name][seq]['seconds']:.2f} s, peak "
                  f"{out[name][seq]['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    return out


def planner() -> dict:
    cases = {"Llama-2-7B tp2 x pp4 + SP": (LLAMA2_7B, Layout(world_size=8, tensor_parallel_degree=2,
                                                              pipeline_parallel_degree=4, sequence_parallel=True,
                                                              device="gpu"), 8),
             "Llama-3-8B tp2 x sharding4 stage2 (PaddleNLP's llama recipe)": (
                 LLAMA3_8B, Layout(world_size=8, tensor_parallel_degree=2, sharding="stage2",
                                   sharding_parallel_degree=4, device="gpu"), 16)}
    out = {}
    for name, (config, layout, accumulation) in cases.items():
        out[name] = {}
        for core, flash in (("dense", False), ("flash", True)):
            model = config_from_dict(config)
            workload = plan_for(model, layout, "--bf16", "--per_device_train_batch_size", "1", "--max_seq_length",
                                "4096", "--gradient_accumulation_steps", str(accumulation),
                                f"--use_flash_attention={flash}").workload()
            shares = plan_layout(model, layout, 2, workload)
            worst = max(shares, key=lambda share: share.total_bytes)
            out[name][core] = {"activations_gb": worst.activation_bytes / 1e9, "total_gb": worst.total_bytes / 1e9}
            print(f"{name}, {core}: worst rank {worst.activation_bytes / 1e9:.1f} GB of activations, "
                  f"{worst.total_bytes / 1e9:.1f} GB in all", flush=True)
    return out


def trainer_runs(lengths: list[int], steps: int, max_gb: float) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seq in lengths:
            for core in ("blockwise", "dense"):
                kept = 30 * CORES[core].saved_bytes(1, seq, SHAPE, 4, False)
                if kept > max_gb * 2**30:
                    out.setdefault(core, {})[seq] = {"skipped": f"its attention keeps {kept / 2**30:.1f} GiB over 30 "
                                                                f"layers by its model (over --max_gb {max_gb})"}
                    print(f"trainer {core:>9} {seq:>5}: skipped, {out[core][seq]['skipped']}", flush=True)
                    continue
                run = Path(tmp) / f"{core}_{seq}"
                subprocess.run([sys.executable, str(REPO / "run_pretrain.py"), *SMOLLM_135M, "--attention_core", core,
                                "--max_seq_length",
                                str(seq), "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                                "--max_steps", str(steps), "--warmup_steps", "1", "--eval_steps", "0", "--eval_iters",
                                "1", "--disable_progress_bar", "--data_cache", f"{tmp}/cache", "--output_dir",
                                str(run)], check=True, cwd=REPO, capture_output=True, timeout=7200)
                speeds = [r["tokens_per_sec"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r][1:]
                out.setdefault(core, {})[seq] = {"tokens_per_sec": statistics.median(speeds)}
                print(f"trainer {core:>9} {seq:>5}: {out[core][seq]['tokens_per_sec']:.0f} tokens/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--trainer_lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max_gb", type=float, default=12.0, help="skip a run whose model keeps more than this")
    args = parser.parse_args()
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "core_shape": [1, "seq", HEADS, KV_HEADS, HEAD_DIM],
           "planner": planner(), "core_runs": core_runs(args.lengths, args.max_gb),
           "trainer": trainer_runs(args.trainer_lengths, args.steps, args.max_gb)}
    write_report(REPO / "bench" / "results" / "attention_cores.json", out)


if __name__ == "__main__":
    main()
