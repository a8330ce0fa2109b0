"""Pretraining arguments: PaddleNLP's flag names, a YAML file as defaults, the command line on top."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from paddle_pp.layout import add_layout_args


def _flag(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class PretrainArguments:
    # model
    model_type: str = _flag("llama", "model family", choices=["llama", "gpt"])
    hidden_size: int = _flag(256, "model width")
    intermediate_size: int = _flag(688, "MLP width")
    num_hidden_layers: int = _flag(4, "decoder layers")
    num_attention_heads: int = _flag(8, "attention heads")
    num_key_value_heads: int = _flag(0, "LLaMA kv heads for GQA (0: as many as attention heads)")
    # data
    corpus: Path = _flag(Path("data/jargon-4.4.7.txt"), "UTF-8 training text; blank lines separate documents")
    tokenizer_dir: Path = _flag(Path("data/tokenizer"), "folder holding tokenizer.model (SentencePiece)")
    data_cache: Path = _flag(Path("data/cache/jargon"), "prefix of the memory-mapped token ids (.bin/.idx.json)")
    max_seq_length: int = _flag(128, "tokens per training sample")
    eval_samples: int = _flag(64, "samples held out at the end of the corpus for evaluation")
    # batch
    per_device_train_batch_size: int = _flag(4, "micro-batch size per data replica")
    gradient_accumulation_steps: int = _flag(2, "micro-batches per step (the pipeline's accumulate steps)")
    global_batch_size: int = _flag(0, "samples per step; 0 derives micro x accumulation x dp x sharding")
    # optimisation
    learning_rate: float = _flag(3e-3, "peak learning rate")
    min_learning_rate: float = _flag(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _flag(20, "linear warmup steps")
    max_steps: int = _flag(300, "optimizer steps")
    weight_decay: float = _flag(0.1, "AdamW decay, applied to matrices only")
    adam_beta1: float = _flag(0.9, "AdamW beta1")
    adam_beta2: float = _flag(0.95, "AdamW beta2")
    adam_epsilon: float = _flag(1e-8, "AdamW epsilon")
    max_grad_norm: float = _flag(1.0, "global-norm clip across all hybrid groups")
    seed: int = _flag(42, "seed of weights and data order")
    initializer_range: float = _flag(0.02, "std of the initial matrices")
    recompute: bool = _flag(False, "recompute each decoder layer in backward")
    bf16: bool = _flag(False, "bfloat16 compute with fp32 master weights (GPU only)")
    fp16: bool = _flag(False, "float16 compute with loss scaling and fp32 master weights (GPU only)")
    amp_master_grad: bool = _flag(False, "keep fp32 gradients under --bf16/--fp16")
    # output
    output_dir: Path = _flag(Path("output"), "metrics.jsonl and loss.png go here")
    logging_steps: int = _flag(1, "write metrics every N steps")
    eval_steps: int = _flag(0, "evaluate every N steps (0: only at the end)")
    eval_iters: int = _flag(2, "global batches of held-out data per evaluation")
    disable_progress_bar: bool = _flag(False, "no progress bar")
    # checkpoints
    save_steps: int = _flag(0, "save a unified checkpoint every N steps (0: never; the last step is saved when > 0)")
    save_total_limit: int = _flag(0, "keep at most N checkpoints, deleting the oldest (0: keep all)")
    resume_from_checkpoint: str = _flag("", "a checkpoint folder, or 'latest' for output_dir's newest committed one")
    async_save: bool = _flag(False, "write checkpoints in the background while training continues")
    save_gradients: bool = _flag(False, "also write the last step's reduced, unclipped gradients into each checkpoint "
                                        "(tools/check_alignment.py compares them)")
    exit_after_steps: int = _flag(0, "stop this run after N steps (saving if --save_steps > 0) while the schedule "
                                     "still spans --max_steps: for job time limits; 0: run to --max_steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain a LLaMA or GPT model under any data x sharding x tensor x pipeline layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML file of flag: value defaults")
    for spec in dataclasses.fields(PretrainArguments):
        meta = dict(spec.metadata)
        if spec.type in ("bool", bool):
            parser.add_argument(f"--{spec.name}", action=argparse.BooleanOptionalAction, default=spec.default, **meta)
        else:
            kind = {"int": int, "float": float, "Path": Path, "str": str}[str(spec.type)]
            parser.add_argument(f"--{spec.name}", type=kind, default=spec.default, **meta)
    return add_layout_args(parser)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line over YAML over built-in defaults; an unknown YAML key is an error, not ignored."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config is not None:
        if not first.config.is_file():
            parser.error(f"--config {first.config} does not exist")
        values = yaml.safe_load(first.config.read_text()) or {}
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"{first.config}: unknown keys {unknown}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)
