"""Fine-tuning costs, side by side in one run, fp32, one process:

1. SFT with and without packing (ours): real (non-padding) tokens per second on a chat set of mixed lengths
   (the test set's generator: 1-3 turns of 4-40 words, Qwen's template), SmolLM-135M's width in 4 layers with
   the chat tokenizer's 2,048-token vocabulary, rows of 512 tokens, 4 a step. Without packing a row is one
   sample and padding, which the model computes too.
2. LoRA (rank 16 on every projection) against full fine-tuning at SmolLM-135M's whole shape (30 layers,
   hidden 576, 9 / 3 heads, vocabulary 49152, tied), 1,024 tokens a step (2 micro-batches of 2 x 256): step
   time (median after the first two steps), optimizer states (bytes), peak resident memory of the process;
   ours (`run_pretrain.py`, the shipped corpus) and PaddleFormers 1.2's own (its LlamaForCausalLM, its
   LoRAModel with the same rank and targets, its Trainer, random tokens), each round alternating the order.
   PaddleFormers' SFT data pipeline is not run: its online datasets import HF `datasets`, which this venv's
   numpy pins keep out (tests/paddleformers_runs.py).
Writes bench/results/finetuning.json.

  .venv/bin/python bench/finetuning.py
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
sys.path.insert(0, str(REPO / "tests"))
from machine import machine, write_report  # noqa: E402

FOLDER = REPO / ".venv" / "paddleformers"
SMOLLM = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49152)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, SEQ, MICRO, ACCUMULATION, SKIPPED = 16, 256, 2, 2, 2
SFT_SEQ, SFT_ROWS = 512, 4

PADDLEFORMERS_RUN = """
import json, resource, sys, time
sys.modules["datasets"] = None  # its Trainer imports datasets only to recognise its datasets
import numpy as np
import paddle
paddle.device.synchronize = lambda *args, **kwargs: None  # raises on CPU; called between micro-batches
from paddleformers.peft import LoRAConfig, LoRAModel
from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
seq, batch, steps, accumulation, output, shape, lora = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                                       int(sys.argv[4]), sys.argv[5], json.loads(sys.argv[6]),
                                                       json.loads(sys.argv[7]))
paddle.seed(0)
model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=seq, tie_word_embeddings=True,
                                     fuse_rms_norm=False))
if lora:
    model = LoRAModel(model, LoRAConfig(**lora))
    model.mark_only_lora_as_trainable()
rows = np.random.default_rng(0).integers(0, shape["vocab_size"], (steps * batch * accumulation + 8, seq + 1))

class Samples(paddle.io.Dataset):
    def __len__(self):
        return len(rows)
    def __getitem__(self, index):
        return {"input_ids": rows[index, :-1], "labels": rows[index, 1:]}

class Clock(TrainerCallback):
    ends = []
    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

args = TrainingArguments(output_dir=output, device="cpu", max_steps=steps, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=accumulation, learning_rate=3e-4, logging_steps=1,
                         amp_master_grad=False, save_steps=10**9, dataloader_shuffle=False, disable_tqdm=True,
                         report_to=[])
trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[Clock()])
trainer.train()
states = sum(int(np.prod(v.shape)) * 4 for k, v in trainer.optimizer.state_dict().items()
             if hasattr(v, "shape") and "pow_acc" not in k)
print(json.dumps({"ends": Clock.ends, "optimizer_bytes": states,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _median_step(ends: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(ends[SKIPPED:], ends[SKIPPED + 1:]))


def paddleformers(lora: bool, steps: int, work: Path) -> dict:
    settings = {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": [f".*{name}.*" for name in TARGETS]} \
        if lora else {}
    done = subprocess.run([sys.executable, "-c", PADDLEFORMERS_RUN, str(SEQ), str(MICRO), str(steps), str(ACCUMULATION),
                           str(work), json.dumps(SMOLLM), json.dumps(settings)],
                          env={**os.environ, "PYTHONPATH": str(FOLDER)}, capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise RuntimeError(f"PaddleFormers failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds_per_step": _median_step(result["ends"]), "optimizer_bytes": result["optimizer_bytes"],
            "peak_rss_mb": result["peak_rss_mb"]}


def _child_peak_mb(command: list[str]) -> float:
    """Run `command`, returning its peak resident memory (MB), measured by a wrapper process of its own."""
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    done = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True, cwd=REPO,
                          timeout=7200)
    if done.returncode:
        raise RuntimeError(f"run failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def ours(lora: bool, steps: int, work: Path) -> dict:
    folder = work.parent / "smollm_config"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **SMOLLM, "tie_word_embeddings": True,
                                                    "max_position_embeddings": SEQ, "rms_norm_eps": 1e-5}))
    adapters = ["--lora", "--lora_rank", str(RANK), "--lora_target_modules", ",".join(TARGETS)] if lora else []
    peak = _child_peak_mb([sys.executable, str(REPO / "run_pretrain.py"), "--model_name_or_path", str(folder),
                           "--no-continue_training", "--max_seq_length", str(SEQ), "--per_device_train_batch_size",
                           str(MICRO), "--gradient_accumulation_steps", str(ACCUMULATION), "--max_steps", str(steps),
                           "--warmup_steps", "1", "--no-do_eval", "--save_steps", str(steps), "--disable_progress_bar",
                           "--data_cache", str(work.parent / "cache"), "--output_dir", str(work), *adapters])
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    index = json.loads((work / f"checkpoint-{steps}" / "optimizer.safetensors.index.json").read_text())
    moments = sum(int(index["metadata"]["files"][f]["size"]) for f in set(index["weight_map"].values()))
    return {"seconds_per_step": _median_step([r["elapsed_s"] for r in records if "loss" in r]),
            "optimizer_bytes": moments, "peak_rss_mb": peak}


def packing(steps: int, work: Path) -> dict:
    """Real tokens per second of SFT with and without packing (ours)."""
    from chat_data import chat_tokenizer, jargon_chats, write_jsonl

    from paddle_pp.data.sft import SampleEncoder, SFTPlan, build_rows
    from paddle_pp.data.tokenizer import load_text_tokenizer

    from runs import CORPUS

    tokenizer = chat_tokenizer("qwen", work / "tokenizer", CORPUS)
    data = write_jsonl(work / "chat.jsonl", jargon_chats(CORPUS, 600))
    body = dict(SMOLLM, num_hidden_layers=4, vocab_size=load_text_tokenizer(tokenizer).vocab_size)
    folder = work / "body"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **body, "tie_word_embeddings": True,
                                                    "max_position_embeddings": SFT_SEQ, "rms_norm_eps": 1e-5}))
    out = {}
    for packed in (False, True):
        run = work / f"sft_{'packed' if packed else 'padded'}"
        subprocess.run([sys.executable, str(REPO / "run_finetune.py"), "--model_name_or_path", str(folder),
                        "--no-continue_training", "--tokenizer_dir", str(tokenizer), "--train_dataset_path", str(data),
                        "--max_seq_length", str(SFT_SEQ), "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", str(SFT_ROWS // 2), "--max_steps", str(steps), "--warmup_steps", "1",
                        "--disable_progress_bar", "--output_dir", str(run), *(["--packing"] if packed else [])],
                       check=True, cwd=REPO, capture_output=True, timeout=7200)
        plan = SFTPlan((data,), (1.0,), (), None, SFT_SEQ, packed, "delete", 42, (SFT_ROWS * steps, 0))
        rows = build_rows(plan, SampleEncoder(load_text_tokenizer(tokenizer)), 0, plan.train_paths, plan.train_probs,
                          SFT_ROWS * steps).rows
        real = [sum(len(sample) for sample in row) for row in rows]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        step = _median_step([r["elapsed_s"] for r in records if "loss" in r])
        out["packed" if packed else "padded"] = {"seconds_per_step": step, "real_tokens_per_row": statistics.mean(real),
                                                 "real_tokens_per_second": SFT_ROWS * statistics.mean(real) / step}
    out["packing_speedup"] = out["packed"]["real_tokens_per_second"] / out["padded"]["real_tokens_per_second"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    report = {**machine(), "measured": time.strftime("%Y-%m-%d"), "shape": SMOLLM, "rank": RANK,
              "tokens_per_step": SEQ * MICRO * ACCUMULATION}
    def run_of(measure, lora: bool):
        return lambda work: measure(lora, args.steps, work)

    runs = {f"{measure.__name__}_{kind}": run_of(measure, kind == "lora")
            for measure in (ours, paddleformers) for kind in ("full", "lora")}
    with tempfile.TemporaryDirectory() as tmp:
        report["sft"] = packing(args.steps, Path(tmp))
        print(json.dumps(report["sft"], indent=1), flush=True)
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for round_ in range(args.rounds):
            for name in (list(runs) if round_ % 2 == 0 else list(reversed(runs))):
                results[name].append(runs[name](Path(tmp) / f"{name}_{round_}"))
                print(f"round {round_}: {name} {results[name][-1]}", flush=True)
    report["lora_vs_full"] = {name: {key: statistics.median(r[key] for r in values) for key in values[0]}
                              for name, values in results.items()}
    for who in ("ours", "paddleformers"):
        full, lora = report["lora_vs_full"][f"{who}_full"], report["lora_vs_full"][f"{who}_lora"]
        report["lora_vs_full"][f"{who}_step_time_ratio"] = lora["seconds_per_step"] / full["seconds_per_step"]
        report["lora_vs_full"][f"{who}_optimizer_ratio"] = lora["optimizer_bytes"] / full["optimizer_bytes"]
    print(json.dumps(report["lora_vs_full"], indent=1))
    write_report(REPO / "bench" / "results" / "finetuning.json", report)


if __name__ == "__main__":
    main()
