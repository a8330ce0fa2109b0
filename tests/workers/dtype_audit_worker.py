"""The trainer built in bf16 (its parameters cast by Paddle's O2 initialisation, fp32 masters) under
a real layout, one training step and one evaluation run under `dtype_audit`: every op's floating
inputs are recorded, and ops CPU has no bf16 kernel for run in fp32 with bf16 results.

argv: run_pretrain.py flags. Result: the ops that met inputs of different dtypes, and the dtypes
the loss and evaluation came out in.
"""

from __future__ import annotations

import sys

from paddle_pp.runtime.lifetime import die_with_launcher


def main(argv: list[str]) -> int:
    from dtype_audit import dtype_audit

    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import precision
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    precision.compute_dtype = lambda *_: "bfloat16"
    trainer = Pretrainer(parse_args(argv))
    with dtype_audit() as mixed:
        record = trainer.train_one_step()
        evaluated = trainer.evaluate()
    write_result({"mixed": mixed, "loss": record["loss"], "eval_loss": evaluated,
                  "parameter_dtypes": sorted({str(p.dtype) for p in trainer.raw_model.parameters()})})
    return 0


if __name__ == "__main__":
    die_with_launcher()
    sys.exit(main(sys.argv[1:]))
