"""Peak memory and throughput of the offline reshard tools against their streaming bound.

Writes a unified LLaMA checkpoint with random weights and AdamW states (no model is built), then
runs each rewrite in a fresh process: `split` (for tp2 pp2), `join` (back), `rechunk` (to 256 MB
shards) and `merge` (from fleet per-rank files made from the split copy). Each child samples its RSS
every 5 ms during the call (peak) and reports it with the RSS before the call (imports: Paddle
and PaddleNLP); the bound is 2 x the largest tensor + 1 GiB, checked on the peak itself and on
the peak above the RSS before the call.
Writes bench/results/reshard_memory.json.

  .venv/bin/python bench/reshard_memory.py --hidden_size 2048 --num_hidden_layers 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from machine import write_report  # noqa: E402

CHILD = """
import json, os, sys, threading, time
sys.path.insert(0, {repo!r})
from paddle_pp.runtime.layout import Layout
from paddle_pp.interop.fleet import merge_fleet
from checkpoint.unified_io import rechunk
from checkpoint.split import join_split, split_checkpoint
from modeling.registry import plan_of_folder
import paddle  # imported before the clock starts, like everything above

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before, peak, running = rss(), [0], [True]

def sample():  # ru_maxrss cannot be reset after the imports' own peak, so sample during the call
    while running[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)

sampler = threading.Thread(target=sample, daemon=True)  # a failing call must not leave it running
sampler.start()
started = time.perf_counter()
{call}
seconds = time.perf_counter() - started
running[0] = False
sampler.join()
print(json.dumps({{"seconds": seconds, "rss_before": before, "peak_rss": max(peak[0], rss())}}))
"""

OPERATIONS = {
    "split tp2 pp2": "split_checkpoint({src!r}, {dst!r}, Layout(world_size=4, tensor_parallel_degree=2, "
                     "pipeline_parallel_degree=2), plan_of_folder({src!r}))",
    "join": "join_split({src!r}, {dst!r})",
    "rechunk 256 MB": "rechunk({src!r}, {dst!r}, 256 * 2**20)",
    "merge fleet tp2 pp2": "merge_fleet({src!r}, {dst!r})",
}


def write_random_checkpoint(folder: Path, config, seed: int = 0) -> int:
    """A unified checkpoint of `config` with random weights and AdamW states; returns its largest tensor's bytes."""
    from checkpoint.durable import write_json_durably
    from checkpoint.format import CONFIG_FILE, MODEL, OPTIMIZER, TRAINER_STATE_FILE, tensor_nbytes
    from checkpoint.save import model_metadata, single_card_config
    from checkpoint.unified_io import write_unified_kind
    from modeling.registry import plan_of

    rng = np.random.default_rng(seed)
    model = {n: {"dtype": "float32", "shape": list(row.shape), "tp_axis": row.placement.tp}
             for n, row in plan_of(config).items()}
    optimizer = {}
    for name, meta in model.items():
        optimizer |= {f"{name}/{state}": meta for state in ("moment1", "moment2")}
        optimizer |= {f"{name}/{state}": {"dtype": "float32", "shape": [1], "tp_axis": None}
                      for state in ("beta1_pow_acc", "beta2_pow_acc")}

    def random(name: str) -> np.ndarray:
        meta = model.get(name) or optimizer[name]
        return rng.standard_normal(meta["shape"], dtype=np.float32)

    folder.mkdir(parents=True)
    layout = {"describe": "random", "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1}
    plan = plan_of(config)
    write_unified_kind(folder, MODEL, model, random, {"saving_layout": layout, **model_metadata(plan)}, 5 * 2**30)
    write_unified_kind(folder, OPTIMIZER, optimizer, random, {"saving_layout": layout}, 5 * 2**30)
    write_json_durably(folder / CONFIG_FILE, single_card_config(config, plan))
    write_json_durably(folder / TRAINER_STATE_FILE, {"step": 1, "consumed_samples": 8, "lr_scheduler": {}})
    return max(tensor_nbytes(meta) for meta in model.values())


def write_fleet_files(split: Path, folder: Path) -> None:
    """PaddleNLP-style per-rank files (model_state / optimizer .pdparams / .pdopt) from a split copy."""
    import paddle

    from checkpoint.format import CONFIG_FILE, TRAINER_STATE_FILE
    from checkpoint.shards import ShardReader
    from checkpoint.split import read_split_index

    index = read_split_index(split)
    folder.mkdir()
    for key, files in index["ranks"].items():
        weights = ShardReader(split / files["model"])
        tensors, table = {}, {}
        for i, name in enumerate(sorted(weights.names)):
            tensors[name] = paddle.to_tensor(weights.read(name))
            tensors[name].name = table[name] = f"param_{key}_{i}"
        paddle.save(tensors, str(folder / f"model_state.{key}.pdparams"))
        del tensors
        states = ShardReader(split / files["optimizer"])
        opt = {f"{table[k.split('/')[0]]}_{k.split('/')[1]}_0": states.read(k) for k in sorted(states.names)}
        paddle.save(opt, str(folder / f"optimizer.{key}.pdopt"))
        del opt
    shutil.copyfile(split / CONFIG_FILE, folder / CONFIG_FILE)
    (folder / TRAINER_STATE_FILE).write_text(json.dumps({"global_step": 1, "consumed_samples": 8}))


def run_child(call: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), call=call)], capture_output=True,
                          text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=2048)
    parser.add_argument("--intermediate_size", type=int, default=5504)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/reshard_memory.json")
    args = parser.parse_args(argv)

    from checkpoint.unified_io import UnifiedReader
    from modeling.llama import LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
                         num_attention_heads=args.hidden_size // 128, num_key_value_heads=args.hidden_size // 128)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="reshard_bench_"))
    try:
        unified = work / "unified"
        largest = write_random_checkpoint(unified, config)
        total = sum(UnifiedReader(unified, k).index["metadata"]["total_size"] for k in ("model", "optimizer"))
        bound = 2 * largest + 2**30
        sources = {"split tp2 pp2": unified, "join": work / "split tp2 pp2", "rechunk 256 MB": unified,
                   "merge fleet tp2 pp2": work / "fleet"}
        rows = []
        for name, call in OPERATIONS.items():
            if name.startswith("merge"):
                write_fleet_files(work / "split tp2 pp2", work / "fleet")
            result = run_child(call.format(src=str(sources[name]), dst=str(work / name)))
            added = result["peak_rss"] - result["rss_before"]
            rows.append({"operation": name, **result, "gb_per_s": total / result["seconds"] / 1e9,
                         "peak_over_bound": result["peak_rss"] / bound, "added_over_largest": added / largest})
            print(f"{name:<22} {result['seconds']:>7.1f} s {total / result['seconds'] / 1e9:>6.2f} GB/s  peak RSS "
                  f"{result['peak_rss'] / 2**30:>5.2f} GiB = {result['peak_rss'] / bound:.2f} x bound; above the "
                  f"{result['rss_before'] / 2**30:.2f} GiB before: {added / 2**20:.0f} MiB = "
                  f"{added / largest:.2f} x largest tensor", flush=True)
        report = {"checkpoint_bytes": total, "largest_tensor_bytes": largest, "bound_bytes": bound,
                  "bound": "2 x largest tensor + 1 GiB", "model": {"hidden_size": args.hidden_size,
                                                                 "num_hidden_layers": args.num_hidden_layers,
                                                                 "vocab_size": args.vocab_size},
                  "measured": time.strftime("%Y-%m-%d"), "rows": rows}
        print(f"checkpoint {total / 1e9:.2f} GB, largest tensor {largest / 2**20:.0f} MiB, bound "
              f"{bound / 2**30:.2f} GiB")
        write_report(args.output, report)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
