"""`run_pretrain.py`'s body: parse, build, train, report; a user error prints one line and exits 2."""

from __future__ import annotations

import sys

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.topology import end_job
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer


def main(argv: list[str] | None = None) -> int:
    try:
        trainer = Pretrainer(parse_args(argv))
    except UserError as err:
        print(f"run_pretrain.py: error: {err}", file=sys.stderr)
        return 2
    history = trainer.train()
    write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in history if "loss" in r],
                  "trained_steps": [r["step"] for r in history if "loss" in r],
                  "grad_norms": [r["grad_norm"] for r in history if "loss" in r],
                  "tokens_per_sec": [r["tokens_per_sec"] for r in history if "loss" in r],
                  "eval_loss": history[-1].get("eval_loss") if history else None,
                  "dataset_built": trainer.train_data is not None, "stage": trainer.topo.pp_rank,
                  "held_elements": trainer.held_after_last_step})
    return end_job(trainer.topo)
