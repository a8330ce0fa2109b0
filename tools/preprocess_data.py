"""Tokenize a corpus into prepared data (`<prefix>.bin` + `<prefix>.idx`, the MMapIndexedDataset format
PaddleNLP and Megatron-LM read): JSON lines (.jsonl, .jsonl.gz) or blank-line-separated text (.txt)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paddle_pp.data.preprocess import preprocess
from paddle_pp.runtime.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", default=["data/jargon-4.4.7.txt"],
                        help="files or globs, read in the order given (each glob sorted)")
    parser.add_argument("--tokenizer_dir", type=Path, default=Path("data/tokenizer"),
                        help="tokenizer.model (SentencePiece) or a folder PaddleNLP's AutoTokenizer loads")
    parser.add_argument("--output_prefix", type=Path, required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--json_key", default="text", help="the text's key in each JSON line")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (output does not depend on it)")
    parser.add_argument("--append_eos", action="store_true", help="end every document with the EOS id")
    parser.add_argument("--add_bos_token", action=argparse.BooleanOptionalAction, default=True,
                        help="begin every document as the tokenizer begins a text (tokenizer_config.json's "
                             "add_bos_token, tokenizer.json's template); --no-add_bos_token: as PaddleNLP does")
    parser.add_argument("--disable_progress_bar", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = preprocess(args.input, args.tokenizer_dir, args.output_prefix, args.json_key, args.workers,
                             args.append_eos, show_progress=not args.disable_progress_bar,
                             add_bos_token=args.add_bos_token)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
