"""Mixed precision on real GPUs, in one command: fp32 and bf16 under every layout the visible GPUs
fit (bf16 held to the fp32 single-card curve within 2e-2, fp32 layouts within 1e-4 with TF32 off),
evaluation at the last step, a bf16 save resumed under another layout in bf16 and in fp32, and fp16
with its loss scaler saved. Prints a table; exits 1 if a row fails, 2 on a machine without a GPU.
It has never run: no GPU with Paddle 3 is reachable from this repository's machines (docs/mixed-precision.md).

  .venv/bin/python bench/gpu_check.py [--work_dir output/gpu_check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    from paddle_pp.training.gpu_check import NoGpuError, run_gpu_check, table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", type=Path, default=Path("output/gpu_check"))
    args = parser.parse_args(argv)
    try:
        rows = run_gpu_check(args.work_dir)
    except NoGpuError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
