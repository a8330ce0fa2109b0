"""Train with our trainer, then save the way PaddleNLP's trainer does without unified checkpoint:
`paddle.save` of each rank's `state_dict()` as model_state.tpXX_ppYY.pdparams and of its optimizer
as optimizer.tpXX_ppYY[_shardZZ].pdopt, plus config.json, scheduler.pdparams and trainer_state.json
(global_step, consumed_samples). Then one more step, whose loss a resume from the merge must equal.

argv: <fleet output dir> <trainer flags...>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import paddle

from checkpoint.format import CONFIG_FILE, TRAINER_STATE_FILE
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.topology import align_ranks, end_job
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer


def suffix(parts: list[tuple[str, int, int]]) -> str:
    return "_".join(f"{name}{rank:02d}" for name, rank, degree in parts if degree > 1)


def save_like_paddlenlp(trainer: Pretrainer, folder: Path) -> None:
    topo, layout = trainer.topo, trainer.layout
    if topo.dp_rank == 0:
        weights = suffix([("tp", topo.tp_rank, layout.tp), ("pp", topo.pp_rank, layout.pp)])
        optimizer = suffix([("tp", topo.tp_rank, layout.tp), ("pp", topo.pp_rank, layout.pp),
                            ("shard", topo.sharding_rank, layout.sharding_degree)])
        if topo.sharding_rank == 0:
            paddle.save(trainer.raw_model.state_dict(), str(folder / f"model_state.{weights}.pdparams"))
        paddle.save(trainer.optimizer.state_dict(), str(folder / f"optimizer.{optimizer}.pdopt"))
    if topo.global_rank == 0:
        (folder / CONFIG_FILE).write_text(json.dumps(trainer.config.to_dict()))
        paddle.save(trainer.schedule.state_dict(), str(folder / "scheduler.pdparams"))
        (folder / TRAINER_STATE_FILE).write_text(json.dumps(
            {"global_step": trainer.step, "consumed_samples": trainer.consumed_samples}))
    align_ranks(topo)  # every file is down before anyone reads the folder


def main() -> int:
    folder, argv = Path(sys.argv[1]), sys.argv[2:]
    folder.mkdir(parents=True, exist_ok=True)
    trainer = Pretrainer(parse_args(argv))
    history = trainer.train()
    save_like_paddlenlp(trainer, folder)
    after = trainer.train_one_step()
    write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in history],
                  "next_loss": after["loss"], "step": trainer.step})
    return end_job(trainer.topo)


if __name__ == "__main__":
    sys.exit(main())
