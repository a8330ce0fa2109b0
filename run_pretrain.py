"""Pretrain LLaMA or GPT: `python run_pretrain.py [--config x.yaml] [flags]`, or under
`python -m paddle.distributed.launch --nproc_per_node N run_pretrain.py ...` for N ranks."""

from __future__ import annotations

import sys

from paddle_pp.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
