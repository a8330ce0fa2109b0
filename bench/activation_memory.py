"""Activation memory with and without sequence parallelism at tp2, measured, and what SP costs in time.

Memory: one LLaMA decoder layer's saved-for-backward bytes on each rank (the dense attention core,
as when this was first measured), by sublayer, measured in real tp processes (`paddle_pp.training.activations`: every tensor an op or PyLayer saves, counted
once, parameters left out) for tp1, tp2 and tp2 + SP, next to the planner's model of the same
bytes. Target (issue 16): the norm activations at 1/tp with SP. Time: run_pretrain.py at tp2 with
and without --sequence_parallel on the same model and data, median tokens/s of the steps after
the first two, per run; medians of --repeats alternating runs. Writes bench/results/activation_memory.json.

  .venv/bin/python bench/activation_memory.py --hidden_size 1024 --max_seq_length 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from modeling.registry import config_from_dict, execution_for, family  # noqa: E402
from paddle_pp.runtime.launch import launch  # noqa: E402
from paddle_pp.runtime.layout import Layout  # noqa: E402
from paddle_pp.training.report import read_metrics  # noqa: E402

WORKER = REPO / "tests" / "workers" / "activation_worker.py"
CASES = {"tp1": (1, False), "tp2": (2, False), "tp2 + SP": (2, True)}


def kind(sublayer: str) -> str:
    if "norm" in sublayer:
        return "norms"
    return "linear inputs" if sublayer.endswith("_proj") else "attention and MLP inside"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--intermediate_size", type=int, default=2816)
    parser.add_argument("--num_attention_heads", type=int, default=16)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = [args.batch, args.max_seq_length, args.hidden_size, args.intermediate_size, args.num_attention_heads,
             args.num_attention_heads]
    config = config_from_dict(dict(model_type="llama", vocab_size=512, hidden_size=args.hidden_size,
                                   intermediate_size=args.intermediate_size, num_hidden_layers=2,
                                   num_attention_heads=args.num_attention_heads,
                                   max_position_embeddings=args.max_seq_length))
    memory = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tp, sp) in CASES.items():
            (rank0, *_) = launch(WORKER, tp, [tp, *shape, f"llama:{int(sp)}"], work_dir=Path(tmp) / name, timeout=900)
            measured = rank0[f"llama:{int(sp)}"]["bytes"]["dense"]
            by_kind: dict[str, int] = {}
            for sublayer, size in measured.items():
                by_kind[kind(sublayer)] = by_kind.get(kind(sublayer), 0) + size
            run = execution_for(Layout(world_size=tp, tensor_parallel_degree=tp, sequence_parallel=sp), 0)
            planned = family("llama").layer_saved_bytes(config, run, args.batch, args.max_seq_length)
            memory[name] = {"by_kind_mb": {k: v / 2**20 for k, v in by_kind.items()},
                            "total_mb": sum(by_kind.values()) / 2**20, "planner_exact": planned == measured}
            print(f"{name:>9}: " + ", ".join(f"{k} {v / 2**20:.2f} MB" for k, v in by_kind.items())
                  + f"; layer {sum(by_kind.values()) / 2**20:.2f} MB; planner exact: {planned == measured}",
                  flush=True)
        plain, split = memory["tp2"], memory["tp2 + SP"]
        norm_ratio = split["by_kind_mb"]["norms"] / plain["by_kind_mb"]["norms"]
        layer_ratio = split["total_mb"] / plain["total_mb"]
        print(f"tp2 + SP / tp2: norms {norm_ratio:.3f} (target 1/tp = 0.5), whole layer {layer_ratio:.3f}")
        model = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.intermediate_size),
                 "--num_hidden_layers", "4", "--num_attention_heads", str(args.num_attention_heads),
                 "--max_seq_length", str(args.max_seq_length), "--per_device_train_batch_size", str(args.batch),
                 "--gradient_accumulation_steps", "1", "--max_steps", str(args.steps), "--warmup_steps", "1",
                 "--eval_steps", "0", "--disable_progress_bar", "--tensor_parallel_degree", "2",
                 "--data_cache", f"{tmp}/cache"]
        runs: dict[str, list[float]] = {"tp2": [], "tp2 + SP": []}
        for repeat in range(args.repeats):  # alternating, so drift in the machine hits both alike
            for name, extra in (("tp2", []), ("tp2 + SP", ["--sequence_parallel"])):
                launch(REPO / "run_pretrain.py", 2, [*model, *extra, "--output_dir", f"{tmp}/{name}_{repeat}_out"],
                       work_dir=Path(tmp) / f"{name}_{repeat}_run", timeout=1800, collect_results=False)
                metrics = read_metrics(Path(tmp) / f"{name}_{repeat}_out" / "metrics.jsonl")
                runs[name].append(statistics.median([r["tokens_per_sec"] for r in metrics if "loss" in r][2:]))
                print(f"{name:>9}: {runs[name][-1]:.0f} tokens/s (median of steps 3-{args.steps})", flush=True)
    speed = {name: statistics.median(values) for name, values in runs.items()}
    print(f"tp2 + SP / tp2 speed: {speed['tp2 + SP'] / speed['tp2']:.3f} (medians of {args.repeats} runs each; "
          + "; ".join(f"{name} {min(v):.0f}-{max(v):.0f}" for name, v in runs.items()) + ")")
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "shape": vars(args), "memory": memory,
           "norm_ratio": norm_ratio, "layer_ratio": layer_ratio, "tokens_per_sec": speed, "runs": runs,
           "speed_ratio": speed["tp2 + SP"] / speed["tp2"]}
    write_report(REPO / "bench" / "results" / "activation_memory.json", out)


if __name__ == "__main__":
    main()
