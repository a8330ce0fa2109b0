"""Checkpoint I/O against the practical limit, side by side in one process.

Builds a LLaMA of about 1 GB (fp32) with random weights and AdamW states, then times, alternating
the methods `--repeats` times: our unified save (`save_checkpoint`: streaming shards, SHA-256,
fsync, atomic commit) and load (`load_checkpoint`: verify + slice reads), bare `safetensors`
save_file/load_file of the same tensors (the practical limit), `paddle.save`/`paddle.load`, and
PaddleNLP's `save_pretrained(safe_serialization=True)` of the weights (the model is a PaddleNLP
PretrainedModel; it writes weights only, so its GB/s is over the weight bytes).
Prints GB/s, the ratios to bare safetensors, and peak RSS; writes bench/results/checkpoint_io.json.

  .venv/bin/python bench/checkpoint_io.py --hidden_size 1024 --num_hidden_layers 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's pages so loads read the disk (best effort, Linux)."""
    for file in ([path] if path.is_file() else path.rglob("*")):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--num_hidden_layers", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=Path("bench/results/checkpoint_io.json"))
    args = parser.parse_args(argv)

    import paddle
    import safetensors.numpy as st

    from checkpoint.load import load_checkpoint
    from checkpoint.optimizer_state import ensure_states, states_by_parameter
    from checkpoint.save import save_checkpoint
    from modeling import build_causal_lm, split_axes
    from modeling.llama.config import LlamaConfig
    from paddle_pp.layout import Layout
    from paddle_pp.topology import init_distributed

    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.hidden_size * 8 // 3 // 64 * 64, num_hidden_layers=args.num_hidden_layers,
                         num_attention_heads=args.hidden_size // 64, max_position_embeddings=2048)
    topo = init_distributed(Layout(world_size=1, device="cpu"))
    built = time.perf_counter()
    model = build_causal_lm(config, topo)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    ensure_states(optimizer)
    rng = np.random.default_rng(0)
    for tensor in [*model.state_dict().values(),
                   *(t for states in states_by_parameter(optimizer).values() for t in states.values())]:
        tensor.set_value(rng.standard_normal(tensor.shape, dtype=np.float32))
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}
    by_param = states_by_parameter(optimizer)
    for name, param in model.state_dict().items():
        tensors |= {f"{name}/{state}": t.numpy() for state, t in by_param[param.name].items()}
    total_gb = sum(a.nbytes for a in tensors.values()) / 1e9
    print(f"model {sum(np.prod(p.shape) for p in model.parameters()) / 1e6:.0f}M params; checkpoint bytes "
          f"{total_gb:.2f} GB (weights + AdamW states); built in {time.perf_counter() - built:.0f}s", flush=True)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    axes = split_axes(config)
    timings: dict[str, list[float]] = {}

    def timed(name, fn):
        start = time.perf_counter()
        fn()
        timings.setdefault(name, []).append(time.perf_counter() - start)

    def fsync_tree(path: Path):
        for file in ([path] if path.is_file() else path.rglob("*")):
            if file.is_file():
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())

    for repeat in range(args.repeats):
        out = work / f"unified{repeat}"
        timed("unified save", lambda: save_checkpoint(out, 1, model, optimizer, topo, axes, config=config,
                                                      trainer_state={"step": 1, "consumed_samples": 0}))
        _drop_page_cache(out)
        timed("unified load", lambda: load_checkpoint(out / "checkpoint-1", model, optimizer, topo, axes))
        bare = work / f"bare{repeat}.safetensors"
        timed("safetensors save", lambda: (st.save_file(tensors, str(bare)), fsync_tree(bare)))
        _drop_page_cache(bare)
        timed("safetensors load", lambda: st.load_file(str(bare)))
        pd = work / f"paddle{repeat}.pdparams"
        paddle_state = {k: paddle.to_tensor(v) for k, v in tensors.items()}
        timed("paddle.save", lambda: (paddle.save(paddle_state, str(pd)), fsync_tree(pd)))
        paddle_state = None  # free before the next load
        _drop_page_cache(pd)
        timed("paddle.load", lambda: paddle.load(str(pd)))
        nlp = work / f"paddlenlp{repeat}"
        timed("paddlenlp save_pretrained", lambda: (model.save_pretrained(str(nlp), safe_serialization=True),
                                                    fsync_tree(nlp)))
        for path in (out, bare, pd, nlp):
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    best = {name: min(times) for name, times in timings.items()}
    weights_gb = sum(v.nbytes for k, v in tensors.items() if "/" not in k) / 1e9
    written = {name: weights_gb if name.startswith("paddlenlp") else total_gb for name in best}
    results = {"checkpoint_gb": total_gb, "weights_gb": weights_gb, "seconds_best_of": args.repeats,
               "gb_per_s": {name: written[name] / t for name, t in best.items()},
               "ratio_unified_save_to_safetensors": best["safetensors save"] / best["unified save"],
               "ratio_unified_load_to_safetensors": best["safetensors load"] / best["unified load"],
               "peak_rss_gb": _rss_gb(), "cpu_count": os.cpu_count()}
    for name, rate in results["gb_per_s"].items():
        print(f"{name:>18}: {rate:6.2f} GB/s (best of {args.repeats})")
    print(f"unified / safetensors: save {results['ratio_unified_save_to_safetensors']:.2f}x, load "
          f"{results['ratio_unified_load_to_safetensors']:.2f}x; peak RSS {results['peak_rss_gb']:.1f} GB")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
