"""Our trainer's tokens/s against PaddleNLP's own `Trainer` on the same model, data and layout, and
how close the single-card step comes to this machine's fp32 matmul rate.

PaddleNLP is what our users would otherwise run, so it is the baseline that matters most. Both
train the same shape of a family PaddleNLP has (`--family llama|qwen2`: its `<Family>ForCausalLM`,
or `<Family>ForCausalLMPipe` when pp > 1; tied embeddings with `--tie_word_embeddings`; our side
starts from a config.json of that shape with `--no-continue_training`),
on the same packed samples of the repo's corpus, with the same global batch, micro-batch and
accumulation, AdamW with global-norm clip 1.0, fp32, one launch of real processes per run (our
CPU backend applied to both). Runs alternate, the order swapped every round; a run's step time is
the wall time from one step's end to the next as the loop sees it (PaddleNLP: `on_step_end`
callbacks, so its data loader and bookkeeping count; ours: `train_one_step`, which includes our
sampler and data path). The ratio of median step rates over all rounds is reported.
PaddleNLP's model keeps its pretraining defaults that apply on CPU (`tensor_parallel_output=True`:
vocabulary-split logits into its parallel cross-entropy, as ours), and it logs and saves nothing
during the measurement, which only favours it.
Model FLOPs utilisation: 6 x parameters x tokens/s plus attention's 12 x layers x sequence x
heads x head_dim per token (forward and backward of QK^T and PV; PaLM's accounting, no recompute),
over the rate of one large fp32 matmul measured in the same run.
Writes bench/results/trainer_vs_paddlenlp.json (or --output).

  .venv/bin/python bench/trainer_vs_paddlenlp.py --layouts single tp2pp2
  .venv/bin/python bench/trainer_vs_paddlenlp.py --family qwen2 --smollm_135m --layouts single
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from machine import machine, write_report  # noqa: E402

LAYOUTS = {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # name -> (tp, pp)
IMPLEMENTATIONS = ("ours", "paddlenlp")
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
# SmolLM-135M's shape (LLaMA architecture, tied): the "real-shape small model"
SMOLLM_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_heads=9, num_key_value_heads=3,
                   vocab_size=49152, tie_word_embeddings=True)


def _shape(args: argparse.Namespace) -> dict:
    """The model's config.json fields (transformers' names), shared by both sides."""
    return dict(model_type=args.family, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                intermediate_size=args.intermediate_size, num_hidden_layers=args.num_hidden_layers,
                num_attention_heads=args.num_heads, num_key_value_heads=args.num_key_value_heads or args.num_heads,
                max_position_embeddings=args.max_seq_length, rms_norm_eps=1e-6,
                tie_word_embeddings=args.tie_word_embeddings)


def parameters(shape: dict) -> int:
    """Parameters of a LLaMA-like model of `shape` (q/k/v biases for qwen2)."""
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if shape["model_type"] == "qwen2" else 0)
    embeddings = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return layers * (attention + 3 * h * f + 2 * h) + h + embeddings


def model_flops_per_token(shape: dict, seq_len: int) -> float:
    return 6 * parameters(shape) + 12 * shape["num_hidden_layers"] * seq_len * shape["hidden_size"]


def matmul_flops_per_second(n: int = 2048, repeats: int = 5) -> float:
    """Best rate of an n x n x n fp32 matmul in Paddle (all cores): this machine's limit for the model."""
    import paddle

    a, b = paddle.randn([n, n]), paddle.randn([n, n])
    paddle.matmul(a, b).numpy()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        paddle.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def _our_step_times(args: argparse.Namespace, tp: int, pp: int, work: Path) -> list[float]:
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    config = work / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.json").write_text(json.dumps(_shape(args)))
    flags = ["--model_name_or_path", str(config), "--no-continue_training",
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

    from paddle_pp.data.source import build_data, dataset_sizes, plan_data
    from paddle_pp.data.tokenizer import load_text_tokenizer
    from paddle_pp.runtime.backends import cpu
    from paddle_pp.runtime.startup import complete_paddlenlp
    from paddle_pp.training.arguments import DataArguments

    cpu.apply()
    paddle.set_device("cpu")
    complete_paddlenlp()  # PaddleNLP's trainer package imports only in its package init's order
    import paddlenlp.transformers as nlp
    from paddlenlp.trainer import Trainer, TrainerCallback, TrainingArguments

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
    samples, _ = build_data(plan_data(
        "", defaults.corpus, defaults.tokenizer_dir, work / "data", defaults.split, defaults.data_impl,
        args.max_seq_length, 42, dataset_sizes(args.global_batch_size, args.warmup + args.steps, 0, 1),
        load_text_tokenizer(defaults.tokenizer_dir).vocab_size))
    config_name, model_name = FAMILIES[args.family]
    shape = {k: v for k, v in _shape(args).items() if k != "model_type"}
    config = getattr(nlp, config_name)(
        **shape, tensor_parallel_degree=tp, tensor_parallel_rank=training.tensor_parallel_rank,
        tensor_parallel_output=True, use_flash_attention=False)
    model = getattr(nlp, model_name + ("Pipe" if pp > 1 else ""))(config)

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
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--smollm_135m", action="store_true", help="SmolLM-135M's shape (sets the shape flags)")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--intermediate_size", type=int, default=704)
    parser.add_argument("--num_hidden_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_key_value_heads", type=int, default=0, help="0: as many as heads")
    parser.add_argument("--tie_word_embeddings", action="store_true")
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
    if args.smollm_135m:  # its shape as defaults; flags given still win (tp2 needs heads divisible by 2)
        parser.set_defaults(**SMOLLM_135M)
        args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    from paddle_pp.runtime.launch import launch

    work = Path(tempfile.mkdtemp(prefix="trainer_vs_paddlenlp_"))
    tokens = args.global_batch_size * args.max_seq_length
    peak = matmul_flops_per_second()
    flops_per_token = model_flops_per_token(_shape(args), args.max_seq_length)
    print(f"{parameters(_shape(args)) / 1e6:.1f}M parameters; fp32 matmul {peak / 1e9:.1f} GFLOP/s", flush=True)
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
        mfu = {name: rate * flops_per_token / peak for name, rate in medians.items()}
        rows[layout] = {"tp": tp, "pp": pp, "tokens_per_s": rates, "median_tokens_per_s": medians,
                        "model_flops_utilisation": mfu,
                        "ratio_ours_over_paddlenlp": medians["ours"] / medians["paddlenlp"]}
        print(f"{layout}: ours / PaddleNLP Trainer = {rows[layout]['ratio_ours_over_paddlenlp']:.3f} (target >= 1.0); "
              f"MFU ours {mfu['ours']:.3f}, PaddleNLP {mfu['paddlenlp']:.3f} of the matmul rate", flush=True)
    report = {"machine": machine(), "model": _model_flags(args), "parameters": parameters(_shape(args)),
              "matmul_flops_per_s": peak, "model_flops_per_token": flops_per_token,
              "measured": time.strftime("%Y-%m-%d"), "layouts": rows}
    write_report(args.output, report)
    return 0


def _model_flags(args: argparse.Namespace) -> list[str]:
    names = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_heads",
             "num_key_value_heads", "max_seq_length", "global_batch_size", "micro_batch_size", "steps", "warmup")
    flags = [item for name in names for item in (f"--{name}", str(getattr(args, name)))]
    return flags + (["--tie_word_embeddings"] if args.tie_word_embeddings else [])


if __name__ == "__main__":
    sys.exit(main())
