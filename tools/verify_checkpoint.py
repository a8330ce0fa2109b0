"""Check a unified checkpoint folder: files present, checksums intact, shards readable, weights shaped
as config.json implies, optimizer keys matching parameters. Prints a report; exits 1 on any problem."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.verify import verify_checkpoint  # noqa: E402
from paddle_pp.report import TensorProgress  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path, help="a checkpoint-<step> folder")
    args = parser.parse_args(argv)
    progress = TensorProgress(sum(p.stat().st_size for p in args.folder.glob("*.safetensors")))
    problems = verify_checkpoint(args.folder, progress)
    progress.close()
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"{args.folder}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
