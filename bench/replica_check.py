"""What the replica check costs a save: the fingerprint pass (a 64-bit sum over every parameter,
on each rank, before anything is written) against the whole synchronous unified save of the same model,
weights and AdamW states, timed side by side in one process, alternating, `--repeats` times.
On one process the all-gather of fingerprints is skipped; across ranks it carries one small dict per
rank (name -> checksum), negligible next to the pass over the bytes measured here.

  .venv/bin/python bench/replica_check.py --hidden_size 1024 --num_hidden_layers 16 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import cpu_model, write_report

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--num_hidden_layers", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/replica_check.json")
    args = parser.parse_args(argv)

    import paddle

    from checkpoint.optimizer_state import ensure_states
    from checkpoint.replicas import check_replicas
    from checkpoint.save import save_checkpoint
    from modeling.llama import LlamaConfig
    from modeling.registry import build_causal_lm, plan_of
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import init_distributed

    topo = init_distributed(Layout(world_size=1))
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.hidden_size * 11 // 4, num_hidden_layers=args.num_hidden_layers,
                         num_attention_heads=args.hidden_size // 64)
    model = build_causal_lm(config, topo)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    ensure_states(optimizer)
    plan = plan_of(config)
    axes = plan.axes()
    weight_bytes = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="replica_check_"))
    checks, saves = [], []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        check_replicas(model.state_dict(), axes, topo, "error")
        checks.append(time.perf_counter() - started)
        started = time.perf_counter()
        save_checkpoint(work / str(repeat), 1, model, optimizer, topo, plan, config=config,
                        trainer_state={"step": 1, "consumed_samples": 0})
        saves.append(time.perf_counter() - started)
        shutil.rmtree(work / str(repeat))
    shutil.rmtree(work)
    report = {"cpu": cpu_model(), "measured": time.strftime("%Y-%m-%d"), "weight_bytes": weight_bytes,
              "check_s": checks, "save_with_check_s": saves,
              "median_check_fraction_of_save": statistics.median(checks) / statistics.median(saves),
              "check_gb_per_s": weight_bytes / statistics.median(checks) / 1e9}
    write_report(args.output, report)
    print(f"weights {weight_bytes / 1e9:.2f} GB: check {statistics.median(checks):.3f} s "
          f"({report['check_gb_per_s']:.2f} GB/s), save incl. check {statistics.median(saves):.3f} s; "
          f"check = {report['median_check_fraction_of_save']:.1%} of the save (medians of {args.repeats}); "
          f"CPU {report['cpu']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
