"""`run_pretrain.py`'s body: parse, build, train, report; a user error prints one line and exits 2."""

from __future__ import annotations

import sys
from typing import Callable

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.topology import end_job
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer


def main(argv: list[str] | None = None, after_update: Callable[[Pretrainer], None] | None = None,
         on_trained: Callable[[Pretrainer, list[dict]], None] | None = None,
         on_built: Callable[[Pretrainer], None] | None = None) -> int:
    """Train as the flags say; `on_built` (before the first step), `after_update` and
    `on_trained(trainer, history)` let a caller observe the run (the test harness records per-rank
    results through them)."""
    try:
        trainer = Pretrainer(parse_args(argv), after_update)
    except UserError as err:
        print(f"run_pretrain.py: error: {err}", file=sys.stderr)
        return 2
    if on_built:
        on_built(trainer)
    history = trainer.train()
    if on_trained:
        on_trained(trainer, history)
    return end_job(trainer.topo)
