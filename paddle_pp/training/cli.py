"""`run_pretrain.py`'s and `run_finetune.py`'s body: parse, build, train, report; a user error prints one
line and exits 2. Fine-tuning is the same trainer with other defaults (`FINETUNE_DEFAULTS`) and chat data."""

from __future__ import annotations

import sys
from typing import Callable

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.topology import end_job
from paddle_pp.training.arguments import FINETUNE_DEFAULTS, parse_args
from paddle_pp.training.trainer import Pretrainer


def main(argv: list[str] | None = None, after_update: Callable[[Pretrainer], None] | None = None,
         on_trained: Callable[[Pretrainer, list[dict]], None] | None = None,
         on_built: Callable[[Pretrainer], None] | None = None, finetune: bool = False) -> int:
    """Train as the flags say; `on_built` (before the first step), `after_update` and
    `on_trained(trainer, history)` let a caller observe the run (the test harness records per-rank
    results through them). `finetune`: run_finetune.py, which needs --train_dataset_path."""
    entry = "run_finetune.py" if finetune else "run_pretrain.py"
    try:
        args = parse_args(argv, FINETUNE_DEFAULTS if finetune else None)
        if finetune and not args.data.train_dataset_path:
            raise UserError("--train_dataset_path is required: the chat data to fine-tune on (JSON lines of "
                            "'messages' or 'src'/'tgt' samples); run_pretrain.py trains on token corpora")
        trainer = Pretrainer(args, after_update)
    except UserError as err:
        print(f"{entry}: error: {err}", file=sys.stderr)
        return 2
    if on_built:
        on_built(trainer)
    history = trainer.train()
    if on_trained:
        on_trained(trainer, history)
    return end_job(trainer.topo)
