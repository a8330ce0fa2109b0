"""Checkpoint I/O against the practical limit, side by side, in one process and across ranks.

For each layout (`single`: one process; `tp2pp2`: 4 ranks, each holding a quarter; `dp4`: 4
data replicas, each holding the whole), builds a LLaMA of about 1 GB (fp32) with random weights
and AdamW states and times, alternating the methods `--repeats` times:
- our unified save (`save_checkpoint`: streaming shards, CRC-32, fsync, atomic commit) and load
  (`load_checkpoint`: names and shapes checked, each file read once and verified), and the same with
  its weights in transformers' layout (`--save_to_hf`: one more read and write of the weights, spread
  over the ranks; loaded as a resume loads it);
- bare `safetensors` save_file/load_file of the same tensors (the practical limit), and
  `paddle.save`/`paddle.load`; across ranks each rank writes and reads its own file of its local
  tensors, as fleet's per-rank checkpoints do (under dp4: a quarter of the bytes each, and, as
  "safetensors one writer", rank 0 alone writing all: the two give the bound the shared disk puts
  on spreading a save over the replicas);
- Paddle's own flex checkpoint (`paddle.distributed.save_state_dict` of every rank's weights and
  AdamW states as ShardedWeights, as PaddleFormers 1.2's trainer saves by default; its load on one
  process only: across ranks Paddle 3.3.1 moves pieces with `.cuda()`, which fails on CPU);
- on one process, PaddleNLP's own unified checkpoint (`save_single_card_checkpoint` and
  `_optimizer`, and their loads: what `Trainer(unified_checkpoint=True)` runs on one card) and its
  `save_pretrained(safe_serialization=True)` (weights only, so its GB/s is over the weight bytes).
Every save ends durable (fsync); page caches are dropped before each load. Across ranks a
method's time runs from a barrier before to a barrier after. GB/s is over the bytes the method
leaves on disk. Prints GB/s, ratios to bare safetensors and peak RSS per rank; writes
bench/results/checkpoint_io.json.

  .venv/bin/python bench/checkpoint_io.py --hidden_size 1024 --num_hidden_layers 16 --layouts single tp2pp2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from machine import machine, write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {"single": (1, 1, 1), "tp2pp2": (2, 2, 1), "dp4": (1, 1, 4)}  # name -> (tp, pp, dp)


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's pages so loads read the disk (best effort, Linux)."""
    for file in ([path] if path.is_file() else path.rglob("*")):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _fsync(path: Path) -> None:
    for file in ([path] if path.is_file() else path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def _random_training_state(config, topo):
    """This rank's model and AdamW states filled with random numbers, and the same as numpy arrays
    under checkpoint names (`name`, `name/state`)."""
    import paddle

    from checkpoint.optimizer_state import ensure_states, states_by_parameter
    from modeling.registry import build_causal_lm, plan_of

    model = build_causal_lm(config, topo)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    ensure_states(optimizer)
    by_param = states_by_parameter(optimizer)
    axes = plan_of(config).axes()
    arrays = {}
    for name, param in model.state_dict().items():
        for key, tensor in [(name, param), *((f"{name}/{state}", t) for state, t in by_param[param.name].items())]:
            # copies that training keeps equal (data replicas, TP-replicated tensors) are drawn equal
            split = axes.get(name) is not None and tensor.shape == param.shape
            rng = np.random.default_rng([zlib.crc32(key.encode()), topo.tp_rank if split else 0])
            tensor.set_value(rng.standard_normal(tensor.shape, dtype=np.float32))
            arrays[key] = tensor.numpy()
    return model, optimizer, arrays


Method = tuple[Callable[[Path], object], Callable[[Path], object] | None]  # save(path), load(path)


def _share(arrays: dict[str, np.ndarray], parts: int, part: int) -> dict[str, np.ndarray]:
    """This part's share of `arrays`, balanced by bytes (largest first to the lightest part)."""
    loads, shares = [0] * parts, [{} for _ in range(parts)]
    for name in sorted(arrays, key=lambda n: (-arrays[n].nbytes, n)):
        lightest = loads.index(min(loads))
        shares[lightest][name] = arrays[name]
        loads[lightest] += arrays[name].nbytes
    return shares[part]


def _flex_state(model, optimizer, topo, plan) -> dict:
    """This rank's weights and AdamW states as Paddle's flex checkpoint takes them (PaddleFormers'
    trainer passes the same): each tensor a ShardedWeight placing its local piece in the whole
    (tp pieces at their offsets; copies on several ranks are stored once by Paddle)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from checkpoint.optimizer_state import states_by_parameter

    axes, by_param, state = plan.axes(), states_by_parameter(optimizer), {}
    for name, param in model.state_dict().items():
        for key, tensor in [(name, param), *((f"{name}/{kind}", t) for kind, t in by_param[param.name].items())]:
            shape, offset = list(tensor.shape), [0] * len(tensor.shape)
            if tensor.shape == param.shape:
                shape = list(plan[name].shape)
                if axes.get(name) is not None and list(tensor.shape) != shape:
                    offset[axes[name]] = topo.tp_rank * tensor.shape[axes[name]]
            state[key] = ShardedWeight(key, tensor, tuple(tensor.shape), tuple(shape), tuple(offset))
    return state


def _methods(model, optimizer, topo, config, arrays: dict[str, np.ndarray]) -> dict[str, Method]:
    import paddle
    import safetensors.numpy as st

    from checkpoint.load import load_checkpoint
    from checkpoint.save import save_checkpoint
    from modeling.registry import plan_of
    from paddle_pp.interop.transformers_layout import TransformersWeights, load_resumed

    plan, rank = plan_of(config), topo.global_rank
    axes = plan.axes()
    whole, replicas = arrays, topo.layout.data_replicas
    arrays = _share(arrays, replicas, topo.data_replica_index) if replicas > 1 else arrays
    methods: dict[str, Method] = {
        "unified": (lambda path: save_checkpoint(path, 1, model, optimizer, topo, plan, config=config,
                                                 trainer_state={"step": 1, "consumed_samples": 0}),
                    lambda path: load_checkpoint(path / "checkpoint-1", model, optimizer, topo, axes)),
        "unified save_to_hf": (
            lambda path: save_checkpoint(path, 1, model, optimizer, topo, plan, config=config,
                                         trainer_state={"step": 1, "consumed_samples": 0},
                                         rewrite=TransformersWeights(config)),
            lambda path: (load_resumed(path / "checkpoint-1", model, axes, topo),
                          load_checkpoint(path / "checkpoint-1", model, optimizer, topo, axes, weights=False))),
        "safetensors": (lambda path: st.save_file(arrays, str(path / f"rank{rank}.safetensors")),
                        lambda path: st.load_file(str(path / f"rank{rank}.safetensors"))),
        "paddle": (lambda path: paddle.save({k: paddle.to_tensor(v) for k, v in arrays.items()},
                                            str(path / f"rank{rank}.pdparams")),
                   lambda path: paddle.load(str(path / f"rank{rank}.pdparams"))),
    }
    import paddle.distributed as dist

    flex = _flex_state(model, optimizer, topo, plan)
    # Paddle 3.3.1's flex load moves pieces between ranks with .cuda(): on CPU it loads in one process only
    methods["paddle flex"] = (lambda path: dist.save_state_dict(flex, str(path)),
                              (lambda path: dist.load_state_dict(flex, str(path))) if topo.layout.world_size == 1
                              else None)
    if replicas > 1:
        methods["safetensors one writer"] = (
            lambda path: st.save_file(whole, str(path / "all.safetensors")) if rank == 0 else None, None)
    if topo.layout.world_size == 1:
        from paddle_pp.runtime.startup import complete_paddlenlp

        complete_paddlenlp()  # PaddleNLP's trainer package imports only in its package init's order
        from paddlenlp.trainer.unified_checkpoint import load_save_single_card as nlp

        methods["paddlenlp unified"] = (
            lambda path: (nlp.save_single_card_checkpoint(model, str(path)),
                          nlp.save_single_card_optimizer(model, optimizer, str(path))),
            lambda path: (nlp.load_single_card_checkpoint(model, str(path)),
                          nlp.load_single_card_optimizer(model, optimizer, str(path))))
        methods["paddlenlp save_pretrained"] = (
            lambda path: model.save_pretrained(str(path), safe_serialization=True), None)
    return methods


def worker(args: argparse.Namespace) -> int:
    from modeling.llama import LlamaConfig
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import align_ranks, end_job, init_distributed

    tp, pp, dp = LAYOUTS[args.layout]
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.hidden_size * 8 // 3 // 64 * 64, num_hidden_layers=args.num_hidden_layers,
                         num_attention_heads=args.hidden_size // 64, max_position_embeddings=2048)
    topo = init_distributed(Layout(world_size=tp * pp * dp, tensor_parallel_degree=tp, pipeline_parallel_degree=pp))
    model, optimizer, arrays = _random_training_state(config, topo)
    methods = _methods(model, optimizer, topo, config, arrays)
    work, seconds, written = args.work_dir, {}, {}

    def timed(name: str, run: Callable[[], object]) -> None:
        align_ranks(topo)
        started = time.perf_counter()
        run()
        align_ranks(topo)
        seconds.setdefault(name, []).append(time.perf_counter() - started)

    for repeat in range(args.repeats):
        for name, (save, load) in methods.items():
            path = work / f"{name.replace(' ', '_')}{repeat}"
            path.mkdir(parents=True, exist_ok=True)
            timed(f"{name} save", lambda: (save(path), _fsync(path)))
            written[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            if load is not None:
                _drop_page_cache(path)
                timed(f"{name} load", lambda: load(path))
            align_ranks(topo)
            if topo.global_rank == 0:
                shutil.rmtree(path)
    write_result({"seconds": seconds, "bytes_on_disk": written,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    return end_job(topo)


def summarize(seconds: dict[str, list[float]], on_disk: dict[str, int], ranks: int, peak_rss_gb: float) -> dict:
    """GB/s of each method's best run, and unified / safetensors ratios by best and by median run
    (the disk is shared: a single lucky run moves the best-of ratio, the median is steadier)."""
    def rate(name: str, pick) -> float:
        return on_disk[name.rsplit(" ", 1)[0]] / 1e9 / pick(seconds[name])

    ratios = {stat: {op: rate(f"unified {op}", pick) / rate(f"safetensors {op}", pick) for op in ("save", "load")}
              for stat, pick in (("best", min), ("median", statistics.median))}
    to_hf = {op: statistics.median(seconds[f"unified save_to_hf {op}"]) / statistics.median(seconds[f"unified {op}"])
             for op in ("save", "load")}
    return {"ranks": ranks, "checkpoint_gb": on_disk["unified"] / 1e9, "bytes_on_disk": on_disk, "seconds": seconds,
            "gb_per_s": {name: rate(name, min) for name in seconds}, "ratio_to_safetensors": ratios,
            "save_to_hf_time_ratio": to_hf, "peak_rss_gb_per_rank": peak_rss_gb}


def dp_scaling(single: dict, dp4: dict) -> dict:
    """How much faster 4 data replicas save than one, next to how much faster the disk takes bare
    files from 4 processes than from 1 (measured in the dp4 run), by median seconds."""
    def rate(row: dict, name: str) -> float:
        return row["bytes_on_disk"][name] / statistics.median(row["seconds"][f"{name} save"])

    speedup = rate(dp4, "unified") / rate(single, "unified")
    bound = rate(dp4, "safetensors") / rate(dp4, "safetensors one writer")
    return {"speedup": speedup, "bound": bound, "share": speedup / bound}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--num_hidden_layers", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["single", "tp2pp2"])
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/checkpoint_io.json")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layout:
        return worker(args)

    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    report = {**machine(), "repeats": args.repeats, "measured": time.strftime("%Y-%m-%d"),
              "model": {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
                        "vocab_size": args.vocab_size}, "layouts": {}}
    for layout in args.layouts:
        tp, pp, dp = LAYOUTS[layout]
        flags = ["--hidden_size", str(args.hidden_size), "--num_hidden_layers", str(args.num_hidden_layers),
                 "--vocab_size", str(args.vocab_size), "--repeats", str(args.repeats), "--layout", layout,
                 "--work_dir", str(work / layout)]
        results = launch(Path(__file__), tp * pp * dp, flags, work_dir=work / f"launch_{layout}", timeout=3600)
        row = summarize(results[0]["seconds"], results[0]["bytes_on_disk"], tp * pp * dp,
                        max(r["peak_rss_gb"] for r in results))
        report["layouts"][layout] = row
        print(f"{layout} ({tp * pp * dp} ranks), checkpoint {row['checkpoint_gb']:.2f} GB:")
        for name, rate in row["gb_per_s"].items():
            print(f"  {name:>30}: {rate:6.2f} GB/s (best of {args.repeats})")
        for stat in ("best", "median"):
            print(f"  unified / safetensors ({stat} of {args.repeats}): save {row['ratio_to_safetensors'][stat]['save']:.2f}x, "
                  f"load {row['ratio_to_safetensors'][stat]['load']:.2f}x")
        print(f"  --save_to_hf / unified (median seconds): save {row['save_to_hf_time_ratio']['save']:.2f}x, "
              f"load {row['save_to_hf_time_ratio']['load']:.2f}x")
        print(f"  peak RSS per rank {row['peak_rss_gb_per_rank']:.1f} GB", flush=True)
    if {"single", "dp4"} <= set(report["layouts"]):
        report["dp4_scaling"] = dp_scaling(report["layouts"]["single"], report["layouts"]["dp4"])
        print("dp4 / dp1 unified save throughput: {speedup:.2f}x; the disk allows {bound:.2f}x (bare files by 4 "
              "processes / by 1); {share:.2f} of the bound (medians)".format(**report["dp4_scaling"]))
    write_report(args.output, report)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
