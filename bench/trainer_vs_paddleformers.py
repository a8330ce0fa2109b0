"""Our trainer's step rate against PaddleFormers 1.2's `Trainer` (README setup: `.venv/paddleformers`),
each with its default settings, on SmolLM-135M's body (hidden 576, intermediate 1536, 10 layers,
9 heads / 3 kv heads, vocabulary 49152, tied), fp32, one process, side by side in one run.

Both train the same global batch of 2,048 tokens per step as 2 accumulated micro-batches: 4 x 256
tokens, then 1 x 1,024. PaddleFormers trains its `LlamaForCausalLM` on random tokens through its
Trainer (its default attention, "eager"; AdamW; `amp_master_grad` off, which its arguments refuse
without bf16/fp16); ours runs `run_pretrain.py` from a config.json of
the same shape (`--no-continue_training`) on the shipped corpus (its default core on this CPU: dense
under 1,024 tokens, blockwise from it). Runs alternate, the
order swapped every round; a run's step time is the median of its steps after the first two (ours:
`elapsed_s` between steps in metrics.jsonl; PaddleFormers: `on_step_end` callbacks).

A third column runs PaddleFormers with the two process settings ours makes for itself, given through
the environment: glibc's malloc keeping freed blocks (`paddle_pp/runtime/host_memory.py`) and one
math thread per core (`backends/cpu.py::set_math_threads`; Paddle's import sets OMP_NUM_THREADS to 1):
how much of the difference is those settings and how much the rest.
Writes bench/results/trainer_vs_paddleformers.json.

  .venv/bin/python bench/trainer_vs_paddleformers.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from machine import machine, write_report  # noqa: E402

FOLDER = REPO / ".venv" / "paddleformers"
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152)
BATCHES = {256: 4, 1024: 1}  # sequence length -> micro-batch (2 accumulated: 2,048 tokens per step)
ACCUMULATION = 2
# what our processes set for themselves (runtime/host_memory.py, backends/cpu.py::set_math_threads), given to
# PaddleFormers through the environment
OUR_PROCESS_SETTINGS = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
SKIPPED_STEPS = 2

PADDLEFORMERS_RUN = """
import json, sys, time
sys.modules["datasets"] = None  # its Trainer imports datasets only to recognise its datasets
import numpy as np
import paddle
paddle.device.synchronize = lambda *args, **kwargs: None  # raises on CPU; called between micro-batches
from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
seq, batch, steps, output = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
shape = json.loads(sys.argv[5])
paddle.seed(0)
model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=seq, tie_word_embeddings=True,
                                     fuse_rms_norm=False))
rows = np.random.default_rng(0).integers(0, shape["vocab_size"], (steps * batch * {accumulation} + 8, seq + 1))

class Samples(paddle.io.Dataset):
    def __len__(self):
        return len(rows)
    def __getitem__(self, index):
        return {{"input_ids": rows[index, :-1], "labels": rows[index, 1:]}}

class Clock(TrainerCallback):
    ends = []
    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

args = TrainingArguments(output_dir=output, device="cpu", max_steps=steps, per_device_train_batch_size=batch,
                         gradient_accumulation_steps={accumulation}, learning_rate=3e-4, logging_steps=1,
                         amp_master_grad=False,
                         save_steps=10**9, dataloader_shuffle=False, disable_tqdm=True, report_to=[])
Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[Clock()]).train()
print(json.dumps({{"ends": Clock.ends}}))
""".format(accumulation=ACCUMULATION)


def paddleformers(seq: int, steps: int, work: Path, extra_env: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(FOLDER), **extra_env}
    done = subprocess.run([sys.executable, "-c", PADDLEFORMERS_RUN, str(seq), str(BATCHES[seq]), str(steps),
                           str(work), json.dumps(SHAPE)], env=env, capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise RuntimeError(f"PaddleFormers failed:\n{done.stderr[-3000:]}")
    ends = json.loads(done.stdout.strip().splitlines()[-1])["ends"]
    return statistics.median(b - a for a, b in zip(ends[SKIPPED_STEPS:], ends[SKIPPED_STEPS + 1:]))


def ours(seq: int, steps: int, work: Path) -> float:
    folder = work.parent / f"config_{seq}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **SHAPE, "tie_word_embeddings": True,
                                                    "max_position_embeddings": seq, "rms_norm_eps": 1e-6}))
    subprocess.run([sys.executable, str(REPO / "run_pretrain.py"), "--model_name_or_path", str(folder),
                    "--no-continue_training", "--max_seq_length", str(seq), "--per_device_train_batch_size",
                    str(BATCHES[seq]), "--gradient_accumulation_steps", str(ACCUMULATION), "--max_steps", str(steps),
                    "--warmup_steps", "1", "--no-do_eval", "--save_steps", "0", "--disable_progress_bar",
                    "--data_cache", str(work.parent / "cache"), "--output_dir", str(work)],
                   check=True, cwd=REPO, capture_output=True, timeout=7200)
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records if "loss" in r]
    return statistics.median(b - a for a, b in zip(elapsed[SKIPPED_STEPS:], elapsed[SKIPPED_STEPS + 1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    runs = {"ours": lambda seq, work: ours(seq, args.steps, work),
            "paddleformers": lambda seq, work: paddleformers(seq, args.steps, work, {}),
            "paddleformers_our_settings": lambda seq, work: paddleformers(seq, args.steps, work,
                                                                          OUR_PROCESS_SETTINGS)}
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "shape": SHAPE, "accumulation": ACCUMULATION,
           "lengths": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.lengths:
            times: dict[str, list[float]] = {name: [] for name in runs}
            for round_ in range(args.rounds):
                order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
                for name in order:
                    times[name].append(runs[name](seq, Path(tmp) / f"{name}_{seq}_{round_}"))
                    print(f"{seq:>5} tokens, round {round_}: {name} {times[name][-1]:.2f} s/step", flush=True)
            medians = {name: statistics.median(values) for name, values in times.items()}
            out["lengths"][seq] = {"seconds_per_step": times, "median": medians,
                                   "ours_vs_paddleformers": medians["paddleformers"] / medians["ours"],
                                   "ours_vs_paddleformers_our_settings": medians["paddleformers_our_settings"]
                                   / medians["ours"]}
            print(f"{seq:>5} tokens: ours {medians['ours']:.2f} s/step, PaddleFormers {medians['paddleformers']:.2f} "
                  f"({out['lengths'][seq]['ours_vs_paddleformers']:.2f}x), with our process settings "
                  f"{medians['paddleformers_our_settings']:.2f} "
                  f"({out['lengths'][seq]['ours_vs_paddleformers_our_settings']:.2f}x)", flush=True)
    write_report(REPO / "bench" / "results" / "trainer_vs_paddleformers.json", out)


if __name__ == "__main__":
    main()
