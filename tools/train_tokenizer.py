"""Train the shipped SentencePiece tokenizer: `python tools/train_tokenizer.py --corpus data/jargon-4.4.7.txt`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paddle_pp.data.tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", type=Path, default=Path("data/jargon-4.4.7.txt"), help="UTF-8 text file")
    parser.add_argument("--output_dir", type=Path, default=Path("data/tokenizer"), help="where tokenizer.model goes")
    parser.add_argument("--vocab_size", type=int, default=4096)
    args = parser.parse_args(argv)
    path = train_tokenizer(args.corpus, args.output_dir, args.vocab_size)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
