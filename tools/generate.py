"""See what a model writes: `python tools/generate.py output/checkpoint-200 --prompt "The hacker"`.

Takes any folder `--model_name_or_path` takes (a checkpoint, a weights-only export, a PaddleNLP or
transformers LLaMA folder) and runs it on one process with the tokenizer it carries. Greedy by
default; `--top_p 0.9` samples, and the same `--seed` gives the same text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paddle_pp.interop.pickled import ALLOW_UNSAFE_PICKLE_HELP
from paddle_pp.runtime.errors import UserError
from paddle_pp.training.generation import load_generator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a model folder")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for several)")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--top_p", type=float, default=0.0, help="0: greedy; else nucleus sampling with this mass")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature when sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer_dir", type=Path, default=None, help="when the folder carries no tokenizer")
    parser.add_argument("--allow_unsafe_pickle", action="store_true", help=ALLOW_UNSAFE_PICKLE_HELP)
    args = parser.parse_args(argv)
    try:
        generator = load_generator(args.model, args.tokenizer_dir, args.allow_unsafe_pickle)
    except UserError as err:
        print(f"generate.py: error: {err}", file=sys.stderr)
        return 2
    for prompt in args.prompt:
        text = generator.complete(prompt, args.max_new_tokens, args.top_p, args.temperature, args.seed)
        print(f"{prompt}{text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
