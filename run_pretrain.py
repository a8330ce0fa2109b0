"""Pretrain LLaMA or GPT: `python run_pretrain.py [--config x.yaml] [flags]`, or under
`python -m paddle.distributed.launch --nproc_per_node N run_pretrain.py ...` for N ranks."""

from __future__ import annotations

import sys

from paddle_pp.arguments import parse_args
from paddle_pp.launch import write_result
from paddle_pp.topology import end_job
from paddle_pp.trainer import USER_ERRORS, Pretrainer


def main(argv: list[str] | None = None) -> int:
    try:
        trainer = Pretrainer(parse_args(argv))
    except USER_ERRORS as err:
        print(f"run_pretrain.py: error: {err}", file=sys.stderr)
        return 2
    history = trainer.train()
    write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in history],
                  "eval_loss": history[-1].get("eval_loss") if history else None,
                  "dataset_built": trainer.data is not None, "stage": trainer.topo.pp_rank})
    return end_job(trainer.topo)


if __name__ == "__main__":
    sys.exit(main())
