"""Check a unified checkpoint folder: files present, checksums intact, shards readable, weights shaped
as config.json implies, optimizer keys matching parameters; or a flex checkpoint (PaddleFormers'):
metadata and pieces readable as data, every tensor wholly covered. Prints a report; exits 1 on any
problem."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint.format import CheckpointError, weights_layout
from checkpoint.verify import verify_checkpoint
from paddle_pp.interop.flex import is_flex, verify_flex
from paddle_pp.interop.pretrained import open_pretrained
from paddle_pp.interop.transformers_layout import checkpoint_plan
from paddle_pp.training.report import tensor_progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path, help="a checkpoint-<step> folder (unified, or PaddleFormers' flex)")
    args = parser.parse_args(argv)
    if is_flex(args.folder):
        problems = verify_flex(args.folder)
        for problem in problems:
            print(f"PROBLEM {problem}")
        print(f"{args.folder} (flex checkpoint): {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    with tensor_progress(sum(p.stat().st_size for p in args.folder.glob("*.safetensors")), "verify") as on_file:
        problems = verify_checkpoint(args.folder, checkpoint_plan, on_file)
    if not problems and weights_layout(args.folder) is not None:  # transformers' names and shapes: the reader's check
        try:
            open_pretrained(args.folder)
        except CheckpointError as err:
            problems.append(str(err))
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"{args.folder}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
