"""Our trainer's tokens/s against a minimal hand-written Paddle loop, alternated in one process.

Both train the same LLaMA shape on the same global batch with the same optimizer (AdamW, the
same warmup-cosine schedule, global-norm clipping at 1.0), one process, fp32. The hand loop is
read a batch, forward, loss, backward, step, clear_grad, from the same initial weights through the
same batches; the trainer step adds what a real run does: its sampler and data path, the schedule,
the reported gradient norm, replica averaging of the loss and the metrics record. Steps alternate
one by one after a warmup, the order swapped every pair; the ratio of median step rates is reported.
Between them the data path alone is timed (a global batch's samples read from the indexed files and
made tensors, as the trainer does): its share of the trainer's step time (target < 1%).
Writes bench/results/trainer_overhead.json.

  .venv/bin/python bench/trainer_overhead.py --hidden_size 256 --num_hidden_layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model, write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _hand_loop(trainer):
    """A second model and optimizer, initialised and configured as the trainer's, stepping through the
    same batches: both runs follow the same trajectory, so neither meets easier numbers (CPU speed
    drifts as training moves, e.g. with subnormal optimizer states)."""
    import paddle

    from checkpoint.single_card_state import init_single_card_weights
    from modeling.registry import build_causal_lm
    from paddle_pp.training.schedule import WarmupCosine

    args, batch = trainer.args.optim, trainer.batches.global_batch
    model = build_causal_lm(trainer.config, trainer.topo)
    init_single_card_weights(model, trainer.plan, trainer.topo, trainer.args.data.seed,
                             trainer.args.model.initializer_range)
    schedule = WarmupCosine(args.learning_rate, args.warmup_steps, args.max_steps, args.min_learning_rate)
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters(),
                                       weight_decay=args.weight_decay,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(args.max_grad_norm))
    criterion, consumed = trainer.criterion, [0]

    def step() -> float:
        inputs, labels = trainer.batch_tensors(trainer.train_data, trainer.sampler.replica_batch(consumed[0], 0, 1))
        consumed[0] += batch
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        return float(loss)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="measured steps of each, alternating one by one")
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/trainer_overhead.json")
    args = parser.parse_args(argv)

    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    work = Path(tempfile.mkdtemp(prefix="trainer_overhead_"))
    flags = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.hidden_size * 11 // 4),
             "--num_hidden_layers", str(args.num_hidden_layers), "--num_attention_heads", str(args.hidden_size // 64),
             "--max_seq_length", str(args.max_seq_length), "--global_batch_size", str(args.global_batch_size),
             "--per_device_train_batch_size", str(args.global_batch_size), "--max_steps", "100000",
             "--warmup_steps", "10", "--data_cache", str(work / "data"), "--output_dir", str(work / "out"),
             "--disable_progress_bar"]
    trainer = Pretrainer(parse_args(flags))
    hand_step = _hand_loop(trainer)
    tokens = args.global_batch_size * args.max_seq_length
    runners = {"trainer": trainer.train_one_step, "hand loop": hand_step}
    for run in runners.values():  # warmup: first-step allocations and kernel selection
        run()
    rates: dict[str, list[float]] = {name: [] for name in runners}
    data_seconds: list[float] = []
    for step in range(args.steps):
        order = list(runners.items())
        for name, run in order if step % 2 == 0 else order[::-1]:  # neither always goes first
            started = time.perf_counter()
            run()
            rates[name].append(tokens / (time.perf_counter() - started))
        started = time.perf_counter()
        trainer.batch_tensors(trainer.train_data, trainer.sampler.replica_batch(trainer.consumed_samples, 0, 1))
        data_seconds.append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["trainer"] / medians["hand loop"]
    for name, values in rates.items():
        print(f"{name:<10} median {medians[name]:>9.0f} tokens/s over {len(values)} steps "
              f"(min {min(values):.0f}, max {max(values):.0f})")
    print(f"trainer / hand loop = {ratio:.3f} (target >= 0.97)")
    data_share = statistics.median(data_seconds) / (tokens / medians["trainer"])
    print(f"data path: median {statistics.median(data_seconds) * 1e3:.3f} ms per global batch = {data_share:.2%} "
          "of the trainer's step (target < 1%)")
    report = {"model": {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
                        "max_seq_length": args.max_seq_length, "global_batch_size": args.global_batch_size},
              "device": "CPU, 1 process", "tokens_per_s": rates, "median_tokens_per_s": medians,
              "ratio_trainer_over_hand_loop": ratio, "data_path_seconds": data_seconds,
              "data_path_share_of_step": data_share, "cpu": cpu_model(), "measured": time.strftime("%Y-%m-%d")}
    write_report(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
