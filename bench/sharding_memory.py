"""Per-rank memory of sharding stage1, stage2 and stage3 at sharding 4 against ZeRO's formulas.

Launches run_pretrain.py on 4 CPU ranks for each stage (same model, same data, 2 steps) and reads
what each rank holds right after its last update, before gradients are cleared (the trainer's
`held_elements`: parameters, gradients and optimizer states, counted from the live tensors, a
buffer shared by two tensors once). With psi parameters in fp32 and AdamW (K = 8 bytes of states per
parameter), ZeRO's per-rank bytes at N = 4 are stage1 4psi + 4psi + 8psi/N, stage2 4psi + 4psi/N +
8psi/N, stage3 (4 + 4 + 8)psi/N. The worst rank is compared with the formula (target: within 15%).
Activations are not part of either. Writes bench/results/sharding_memory.json.

  .venv/bin/python bench/sharding_memory.py --hidden_size 512 --num_hidden_layers 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from paddle_pp.runtime.launch import launch  # noqa: E402

SHARDING = 4
ZERO_BYTES = {  # bytes per parameter held by one of N sharding ranks (fp32 weights and grads, AdamW states)
    "stage1": lambda n: 4 + 4 + 8 / n,
    "stage2": lambda n: 4 + 4 / n + 8 / n,
    "stage3": lambda n: (4 + 4 + 8) / n,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--intermediate_size", type=int, default=1408)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--stage3_segment_size", type=int, default=4096)
    args = parser.parse_args()
    model = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.intermediate_size),
             "--num_hidden_layers", str(args.num_hidden_layers), "--num_attention_heads", "8",
             "--num_key_value_heads", "8", "--max_seq_length", "32", "--global_batch_size", "8",
             "--per_device_train_batch_size", "1", "--max_steps", "2", "--warmup_steps", "1", "--eval_steps", "0",
             "--disable_progress_bar", "--stage3_segment_size", str(args.stage3_segment_size)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        single = launch(REPO / "run_pretrain.py", 1, [*model, "--output_dir", f"{tmp}/single", "--data_cache",
                                                      f"{tmp}/cache"], work_dir=Path(tmp) / "single_job")
        psi = single[0]["held_elements"]["parameters"]
        for stage, per_param in ZERO_BYTES.items():
            results = launch(REPO / "run_pretrain.py", SHARDING,
                             [*model, "--sharding", stage, "--sharding_parallel_degree", str(SHARDING),
                              "--output_dir", f"{tmp}/{stage}", "--data_cache", f"{tmp}/cache"],
                             work_dir=Path(tmp) / f"{stage}_job", timeout=900)
            worst = max(results, key=lambda r: sum(r["held_elements"][k] for k in
                                                   ("parameters", "gradients", "optimizer_states")))
            held = {k: worst["held_elements"][k] * 4 for k in ("parameters", "gradients", "optimizer_states")}
            measured, formula = sum(held.values()), per_param(SHARDING) * psi
            rows.append({"stage": stage, "rank": worst["rank"], "measured_mb": {k: v / 2**20 for k, v in held.items()},
                         "measured_total_mb": measured / 2**20, "zero_formula_mb": formula / 2**20,
                         "ratio": measured / formula})
            print(f"{stage}: worst rank {worst['rank']} holds {measured / 2**20:.1f} MB (weights "
                  f"{held['parameters'] / 2**20:.1f}, grads {held['gradients'] / 2**20:.1f}, states "
                  f"{held['optimizer_states'] / 2**20:.1f}); ZeRO {formula / 2**20:.1f} MB; ratio "
                  f"{measured / formula:.3f}", flush=True)
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "parameters": psi, "sharding": SHARDING,
           "model": model, "stages": rows}
    write_report(REPO / "bench" / "results" / "sharding_memory.json", out)


if __name__ == "__main__":
    main()
