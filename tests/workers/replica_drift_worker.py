"""Train one step on tp2, then make tp rank 1's copy of a replicated norm weight drift (as
non-deterministic GPU kernels can) and save: with --replica_check error the save must fail on both
ranks naming the tensor, with warn it must be written.

argv: run_pretrain.py flags
"""

from __future__ import annotations

import sys
from pathlib import Path

from checkpoint.replicas import ReplicaMismatchError
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.topology import end_job
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer

DRIFTING = "llama.norm.weight"


def main() -> int:
    trainer = Pretrainer(parse_args(sys.argv[1:]))
    trainer.train()
    if trainer.topo.tp_rank == 1:
        weight = trainer.raw_model.state_dict()[DRIFTING]
        weight.set_value(weight + 1e-6)
    output, outcomes, written = Path(trainer.args.output.output_dir), {}, {}
    for mode in ("error", "warn"):
        trainer.args.checkpoint.replica_check = mode
        try:
            trainer.save()
            outcomes[mode] = None
        except ReplicaMismatchError as err:
            outcomes[mode] = str(err)
        written[mode] = sorted(p.name for p in output.iterdir() if "checkpoint" in p.name or p.name == "latest")
    write_result({"rank": trainer.topo.global_rank, "outcomes": outcomes, "written": written})
    return end_job(trainer.topo)


if __name__ == "__main__":
    sys.exit(main())
