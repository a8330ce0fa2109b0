"""Tokenize a corpus into the memory-mapped ids the trainer reads (`<prefix>.bin` + `<prefix>.idx.json`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paddle_pp.data.tokens import preprocess


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", type=Path, default=Path("data/jargon-4.4.7.txt"))
    parser.add_argument("--tokenizer_dir", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--output_prefix", type=Path, default=Path("data/cache/jargon"))
    args = parser.parse_args(argv)
    index = preprocess(args.corpus, args.tokenizer_dir, args.output_prefix)
    print(f"{index['num_tokens']} tokens from {index['num_documents']} documents -> {args.output_prefix}.bin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
