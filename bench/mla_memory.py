"""Per-rank memory of multi-head latent attention against grouped-query attention of the same width,
the planner against measurement, at tp1 and tp2.

Two decoder-only models alike but for attention: DeepSeek-V2-Lite's latent attention (hidden 2048,
16 heads, kv latent 512, q/k heads 128 + 64 rotary, v heads 128, no q latent; every layer dense, so
the MLPs match) and a LLaMA with 16 heads of 128 and 4 kv heads. Measured in real tp processes on
every rank: the parameters a rank builds, and what one decoder layer keeps for backward
(`paddle_pp.training.activations`: every tensor an op or PyLayer saves, counted once, parameters
left out), next to the planner's model of both (`paddle_pp.planning.memory.plan_layout`, the
families' `layer_saved_bytes`). Byte counts, so the ratios do not depend on the machine. Writes
bench/results/mla_memory.json.

  .venv/bin/python bench/mla_memory.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine  # noqa: E402

WIDTH = dict(vocab_size=4096, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
             max_position_embeddings=4096)
CONFIGS = {
    "GQA (LLaMA, 4 kv heads of 128)": dict(WIDTH, model_type="llama", num_key_value_heads=4),
    "MLA (DeepSeek-V2-Lite's)": dict(WIDTH, model_type="deepseek_v2", num_key_value_heads=16, q_lora_rank=None,
                                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                     first_k_dense_replace=2, num_experts=4, n_group=1, topk_group=1,
                                     num_experts_per_tok=2, moe_intermediate_size=1408),
}


def measure(tp: int, batch: int, seq_len: int) -> dict:
    """On this rank of a tp launch: each model's parameter count and its first layer's saved bytes."""
    from modeling.execution import Execution
    from modeling.registry import build_causal_lm, config_from_dict
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import end_job, init_distributed
    from paddle_pp.training.activations import decoder_layer_activations

    topo = init_distributed(Layout(world_size=tp, tensor_parallel_degree=tp))
    result = {"tp_rank": topo.tp_rank}
    for name, fields in CONFIGS.items():
        config = config_from_dict(fields)
        model = build_causal_lm(config, topo, Execution())
        model.train()
        layer = sum(decoder_layer_activations(model, config.vocab_size, batch, seq_len).values())
        result[name] = {"parameters": sum(int(p.size) for p in model.parameters()), "layer_saved_bytes": layer}
        del model
    write_result(result)
    end_job(topo)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--worker_tp", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_tp:
        measure(args.worker_tp, args.batch, args.max_seq_length)
        return
    from modeling.registry import config_from_dict, execution_for, family_of
    from paddle_pp.planning.memory import plan_layout
    from paddle_pp.runtime.launch import launch
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.training.run_plan import plan_for

    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            ranks = launch(Path(__file__), tp, ["--worker_tp", str(tp), "--batch", str(args.batch), "--max_seq_length",
                                                str(args.max_seq_length)], work_dir=Path(tmp) / f"tp{tp}", timeout=1800)
            layout = Layout(world_size=tp, tensor_parallel_degree=tp)
            for name, fields in CONFIGS.items():
                config = config_from_dict(fields)
                workload = plan_for(config, layout, "--per_device_train_batch_size", str(args.batch),
                                    "--max_seq_length", str(args.max_seq_length), "--no-use_flash_attention").workload()
                shares = sorted(plan_layout(config, layout, workload=workload), key=lambda s: s.tp_rank)
                run = execution_for(layout, 0)
                planned_layer = sum(family_of(config).layer_saved_bytes(config, run, args.batch,
                                                                         args.max_seq_length).values())
                for rank in sorted(ranks, key=lambda r: r["tp_rank"]):
                    got = rank[name]
                    share = shares[rank["tp_rank"]]
                    rows.append({"tp": tp, "tp_rank": rank["tp_rank"], "model": name, **got,
                                 "planned_parameters": share.parameters, "planned_layer_saved_bytes": planned_layer})
    print(f"{'model':<32} {'tp':>2} {'rank':>4} {'params (M)':>11} {'planner':>8} {'layer saved MB':>15} {'planner':>8}")
    for row in rows:
        print(f"{row['model']:<32} {row['tp']:>2} {row['tp_rank']:>4} {row['parameters'] / 1e6:>11.2f} "
              f"{'exact' if row['parameters'] == row['planned_parameters'] else 'OFF':>8} "
              f"{row['layer_saved_bytes'] / 2**20:>15.2f} "
              f"{'exact' if row['layer_saved_bytes'] == row['planned_layer_saved_bytes'] else 'OFF':>8}")
    for tp in (1, 2):
        mla, gqa = ([r for r in rows if r["tp"] == tp and r["tp_rank"] == 0 and r["model"].startswith(kind)][0]
                    for kind in ("MLA", "GQA"))
        out[f"tp{tp}"] = {"parameters": mla["parameters"] / gqa["parameters"],
                          "layer_saved_bytes": mla["layer_saved_bytes"] / gqa["layer_saved_bytes"]}
        print(f"tp{tp} rank 0, MLA / GQA: parameters {out[f'tp{tp}']['parameters']:.3f}, one layer's saved "
              f"activations {out[f'tp{tp}']['layer_saved_bytes']:.3f}")
    (REPO / "bench" / "results" / "mla_memory.json").write_text(json.dumps(
        {**machine(), "measured": time.strftime("%Y-%m-%d"), "shape": {"batch": args.batch, "max_seq_length":
                                                                       args.max_seq_length}, "rows": rows,
         "ratios": out},
        indent=1))


if __name__ == "__main__":
    main()
