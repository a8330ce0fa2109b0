"""Sliding windows in the blockwise core, measured on this CPU, and the planner on windowed models.

1. One attention layer's core, forward + backward, one process per (window, length) so peaks do not
   mix: time and peak allocator bytes (Paddle's CPU statistic, above the inputs) at 8k, 16k and 32k
   tokens, [1, seq, 4 heads (2 kv), 64], full causal against windows of 4096 and 512 keys (blocks of
   512): a windowed layer's time should grow linearly in the length, full causal's quadratically;
   what either keeps is the same (q, k, v, output, log-sum-exp).
2. `tools/reshard.py plan`'s model for Gemma-3-27B (text) and Gemma-2-9B at 8192 tokens in bf16 on
   GPUs, full layers against sliding ones: per-layer activations under each core (the dense core keeps
   seq^2 scores whatever the window; flash and blockwise keep O(seq)), and the worst rank's total.
Writes bench/results/windowed_attention.json.

  .venv/bin/python bench/windowed_attention.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from modeling.execution import Execution, choose_execution  # noqa: E402
from modeling.registry import config_from_dict, execution_for, family_of  # noqa: E402
from paddle_pp.planning.memory import plan_layout  # noqa: E402
from paddle_pp.runtime.layout import Layout  # noqa: E402
from paddle_pp.training.run_plan import plan_for  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 512
CORE_RUN = """
import json, sys, time
import paddle
from modeling.attention_core import BlockwiseCore
from modeling.attention_core.spec import CoreSpec
from paddle_pp.training.activations import host_allocated
from paddle.base import core
window, seq = int(sys.argv[1]) or None, int(sys.argv[2])
q, k, v = (paddle.randn([1, seq, n, {head_dim}]) for n in ({heads}, {kv}, {kv}))
for t in (q, k, v):
    t.stop_gradient = False
upstream = paddle.randn([1, seq, {heads} * {head_dim}])
times = []
for repeat in range(2):
    start = host_allocated()
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    began = time.perf_counter()
    (BlockwiseCore({block})(q, k, v, False, CoreSpec(window=window)) * upstream).sum().backward()
    times.append(time.perf_counter() - began)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - start
print(json.dumps({{"seconds": min(times), "peak_bytes": peak}}))
""".format(heads=HEADS, kv=KV_HEADS, head_dim=HEAD_DIM, block=BLOCK)
GEMMA3_27B = {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
              "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
              "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072}
GEMMA2_9B = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
             "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 8192}


def core_runs(lengths: list[int], windows: list[int]) -> dict:
    out: dict[str, dict] = {}
    for window in [0, *windows]:
        name = f"window {window}" if window else "full causal"
        out[name] = {}
        for seq in lengths:
            done = subprocess.run([sys.executable, "-c", CORE_RUN, str(window), str(seq)], capture_output=True,
                                  text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"},
                                  timeout=7200)
            out[name][seq] = json.loads(done.stdout.strip().splitlines()[-1]) if not done.returncode else \
                {"failed": f"exit status {done.returncode}"}
            print(f"{name:>12} {seq:>6}: {out[name][seq]}", flush=True)
    return out


def planner(seq_len: int) -> dict:
    """Per model: each distinct layer's activations per micro-batch under the flash and the dense core
    (bf16, tp4 + SP on one stage of pp2 ... the layout below), and the worst rank's totals."""
    cases = {"Gemma-3-27B tp4 x pp2 + SP": (GEMMA3_27B, Layout(world_size=8, tensor_parallel_degree=4,
                                                                pipeline_parallel_degree=2, sequence_parallel=True,
                                                                device="gpu")),
             "Gemma-2-9B tp2 x pp2 + SP": (GEMMA2_9B, Layout(world_size=4, tensor_parallel_degree=2,
                                                              pipeline_parallel_degree=2, sequence_parallel=True,
                                                              device="gpu"))}
    out = {}
    for name, (fields, layout) in cases.items():
        config = config_from_dict(dict(fields))
        out[name] = {}
        for core, flash in (("flash", True), ("dense", False)):
            choices, _ = choose_execution(flash, device="gpu", dtype="bfloat16", head_dim=config.head_dim, sm=(9, 0))
            run: Execution = execution_for(layout, 0, choices)
            per_layer = {}
            for index in (0, config.attention_types().index("full_attention")):
                kind = config.attention_types()[index]
                kept = family_of(config).layer_activations(config, run, 1, seq_len, 2, index=index).kept
                per_layer[kind] = kept / 2**30
            workload = plan_for(config, layout, "--bf16", "--per_device_train_batch_size", "1", "--max_seq_length",
                                str(seq_len), "--gradient_accumulation_steps", "8",
                                f"--use_flash_attention={flash}").workload()
            worst = max(plan_layout(config, layout, 2, workload), key=lambda share: share.total_bytes)
            out[name][core] = {"layer_activations_gib": per_layer, "worst_rank_activations_gib":
                               worst.activation_bytes / 2**30, "worst_rank_total_gib": worst.total_bytes / 2**30}
            print(f"{name}, {core}: {out[name][core]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 512])
    args = parser.parse_args()
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "core_shape": [1, "seq", HEADS, KV_HEADS, HEAD_DIM],
           "block": BLOCK, "planner_8k": planner(8192), "core_runs": core_runs(args.lengths, args.windows)}
    write_report(REPO / "bench" / "results" / "windowed_attention.json", out)


if __name__ == "__main__":
    main()
