"""Our trainer's tokens/s against PaddleNLP's own `Trainer` on the same model, data and layout.

PaddleNLP is what our users would otherwise run, so it is the baseline that matters most. Both
train the same LLaMA shape (PaddleNLP's `LlamaForCausalLM`, or `LlamaForCausalLMPipe` when pp > 1),
on the same packed samples of the repo's corpus, with the same global batch, micro-batch and
accumulation, AdamW with global-norm clip 1.0, fp32, one launch of real processes per run (our
CPU backend applied to both). Runs alternate, the order swapped every round; a run's step time is
the wall time from one step's end to the next as the loop sees it (PaddleNLP: `on_step_end`
callbacks, so its data loader and bookkeeping count; ours: `train_one_step`, which includes our
sampler and data path). The ratio of median step rates over all rounds is reported.
PaddleNLP's model keeps its pretraining defaults that apply on CPU (`tensor_parallel_output=True`:
vocabulary-split logits into its parallel cross-entropy, as ours), and it logs and saves nothing
during the measurement, which only favours it.
Writes bench/results/trainer_vs_paddlenlp.json.

  .venv/bin/python bench/trainer_vs_paddlenlp.py --layouts single tp2pp2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # name -> (tp, pp)
IMPLEMENTATIONS = ("ours", "paddlenlp")


def _our_step_times(args: argparse.Namespace, tp: int, pp: int, work: Path) -> list[float]:
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    flags = ["--hidden_size", str(args.hidden_size), "--intermediate_size", str(args.intermediate_size),
             "--num_hidden_layers", str(args.num_hidden_layers), "--num_attention_heads", str(args.num_heads),
             "--max_seq_length", str(args.max_seq_length), "--global_batch_size", str(args.global_batch_size),
             "--per_device_train_batch_size", str(args.micro_batch_size),
             "--tensor_parallel_degree", str(tp), "--pipeline_parallel_degree", str(pp),
             "--max_steps", "100000", "--warmup_steps", "10", "--data_cache", str(work / "data"),
             "--output_dir", str(work / "ours"), "--disable_progress_bar"]
    trainer = Pretrainer(parse_args(flags))
    times = []
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        trainer.train_one_step()
        times.append(time.perf_counter() - started)
    return times[args.warmup:]


def _paddlenlp_step_times(args: argparse.Namespace, tp: int, pp: int, work: Path) -> list[float]:
    import paddle
    from paddle.distributed import fleet

    from paddle_pp.runtime.backends import cpu
    from paddle_pp.data.source import build_data, dataset_sizes, plan_data
    from paddle_pp.data.tokenizer import load_text_tokenizer
    from paddle_pp.training.arguments import DataArguments

    cpu.apply()
    paddle.set_device("cpu")
    from paddlenlp.trainer import Trainer, TrainerCallback, TrainingArguments
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM, LlamaForCausalLMPipe

    accumulate = args.global_batch_size // args.micro_batch_size
    training = TrainingArguments(
        output_dir=str(work / "paddlenlp"), device="cpu", max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=accumulate,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=10, weight_decay=0.1, adam_beta2=0.95,
        max_grad_norm=1.0, logging_steps=100000, save_strategy="no", disable_tqdm=True, report_to=[],
        dataloader_num_workers=0, seed=42, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
        pipeline_parallel_config="disable_partial_send_recv disable_batch_p2p_comm")
    if pp > 1:
        cpu.create_pipeline_edge_groups(fleet.get_hybrid_communicate_group(), wrap_around=False)
    defaults = DataArguments()
    vocab_size = load_text_tokenizer(defaults.tokenizer_dir).vocab_size
    samples, _ = build_data(plan_data(
        "", defaults.corpus, defaults.tokenizer_dir, work / "data", defaults.split, defaults.data_impl,
        args.max_seq_length, 42, dataset_sizes(args.global_batch_size, args.warmup + args.steps, 0, 1), vocab_size))
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads, rms_norm_eps=1e-6,
        max_position_embeddings=args.max_seq_length, tensor_parallel_degree=tp,
        tensor_parallel_rank=training.tensor_parallel_rank, tensor_parallel_output=True, use_flash_attention=False)
    model = (LlamaForCausalLMPipe if pp > 1 else LlamaForCausalLM)(config)

    class Samples(paddle.io.Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            ids = samples[i]
            return {"input_ids": ids[:-1], "labels": ids[1:]}

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    step_ends.append(time.perf_counter())
    Trainer(model=model, args=training, train_dataset=Samples(), callbacks=[StepClock()]).train()
    times = [b - a for a, b in zip(step_ends, step_ends[1:])]
    return times[args.warmup:]


def worker(args: argparse.Namespace) -> int:
    from paddle_pp.runtime.backends import cpu
    from paddle_pp.runtime.launch import write_result

    tp, pp = LAYOUTS[args.layout]
    measure = _our_step_times if args.worker == "ours" else _paddlenlp_step_times
    write_result({"step_seconds": measure(args, tp, pp, args.work_dir)})
    if tp * pp > 1:
        cpu.exit_process(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["single", "tp2pp2"])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--intermediate_size", type=int, default=704)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--max_seq_length", type=int, default=256)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps per run before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/trainer_vs_paddlenlp.json")
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--work_dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="trainer_vs_paddlenlp_"))
    tokens = args.global_batch_size * args.max_seq_length
    rows = {}
    for layout in args.layouts:
        tp, pp = LAYOUTS[layout]
        rates: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for round_ in range(args.rounds):
            for name in IMPLEMENTATIONS if round_ % 2 == 0 else IMPLEMENTATIONS[::-1]:
                job = work / f"{layout}_{name}_{round_}"
                flags = [*_model_flags(args), "--worker", name, "--layout", layout, "--work_dir", str(job)]
                result = launch(Path(__file__), tp * pp, flags, work_dir=job / "launch", timeout=900)[0]
                rates[name] += [tokens / s for s in result["step_seconds"]]
                print(f"{layout} round {round_} {name:<9}: median "
                      f"{statistics.median(tokens / s for s in result['step_seconds']):.0f} tokens/s", flush=True)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        rows[layout] = {"tp": tp, "pp": pp, "tokens_per_s": rates, "median_tokens_per_s": medians,
                        "ratio_ours_over_paddlenlp": medians["ours"] / medians["paddlenlp"]}
        print(f"{layout}: ours / PaddleNLP Trainer = {rows[layout]['ratio_ours_over_paddlenlp']:.3f} (target >= 1.0)",
              flush=True)
    report = {"device": f"CPU, {os.cpu_count()} cores, one process per rank", "model": _model_flags(args),
              "measured": time.strftime("%Y-%m-%d"), "layouts": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _model_flags(args: argparse.Namespace) -> list[str]:
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_heads", "max_seq_length",
             "global_batch_size", "micro_batch_size", "steps", "warmup")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


if __name__ == "__main__":
    sys.exit(main())
