"""Precision alignment before a long job: from one checkpoint, train N steps on one card and under
a layout; print the per-step loss table and the worst per-tensor differences of parameters and of
the last step's gradients, write a PNG, and exit 1 past the tolerance.

  python tools/check_alignment.py output/run/checkpoint-100 --nproc 4 --steps 5 \\
      --tensor_parallel_degree 2 --pipeline_parallel_degree 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paddle_pp.runtime.errors import UserError
from paddle_pp.training.alignment import check_alignment, plot_alignment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--nproc", type=int, required=True, help="ranks of the layout run")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="largest relative difference accepted; 1e-5 is for fp32 (TF32 is turned off for both "
                             "runs); a --bf16 checkpoint's runs differ by bf16 rounding, so pass e.g. 2e-2")
    parser.add_argument("--work_dir", type=Path, default=Path("output/alignment"))
    args, layout_flags = parser.parse_known_args(argv)
    try:
        report = check_alignment(args.checkpoint, layout_flags, args.nproc, args.steps, args.work_dir, args.rtol)
    except UserError as err:
        print(f"check_alignment.py: error: {err}", file=sys.stderr)
        return 2
    print(report.table())
    png = plot_alignment(report, args.work_dir / "alignment.png")
    verdict = "ALIGNED" if report.aligned else "NOT ALIGNED"
    print(f"{verdict}: worst loss rel diff {report.worst_loss_rel:.2e}, parameter {report.worst_tensor_rel:.2e}, "
          f"gradient {report.worst_gradient_rel:.2e} (tolerance {args.rtol:g}); plot: {png}")
    return 0 if report.aligned else 1


if __name__ == "__main__":
    sys.exit(main())
