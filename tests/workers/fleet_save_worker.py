"""Train with our trainer, then save the way PaddleNLP's trainer does without unified checkpoint:
`paddle.save` of each rank's `state_dict()` as model_state.tpXX_ppYY.pdparams and of its optimizer
as optimizer.tpXX_ppYY[_shardZZ].pdopt, plus config.json, scheduler.pdparams and trainer_state.json
(global_step, consumed_samples); and the way PaddleFormers 1.2's trainer does by default, a flex
checkpoint in <fleet output dir>/flex: every rank's pieces through Paddle's own `save_state_dict`
under transformers' names, linears in Paddle's layout and the head as transformers keeps it,
AdamW's states as `<name>.moment1_0` ..., trainer_state.bin (PaddleFormers' TrainerState, pickled
by paddle.save) and scheduler.pdparams. Then one more step, whose loss a resume from either must equal.

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


def _trainer_state_class():
    """A class pickled under PaddleFormers' name for its TrainerState (its fields as 1.2 declares them)."""
    import dataclasses
    import types

    for name in ("paddleformers", "paddleformers.trainer", "paddleformers.trainer.trainer_callback"):
        sys.modules.setdefault(name, types.ModuleType(name))
    fields = [("epoch", float, None), ("global_step", int, 0), ("consumed_samples", int, 0), ("max_steps", int, 0)]
    cls = dataclasses.make_dataclass("TrainerState", [(n, t, dataclasses.field(default=d)) for n, t, d in fields])
    cls.__module__ = "paddleformers.trainer.trainer_callback"
    sys.modules[cls.__module__].TrainerState = cls
    return cls


def save_like_paddleformers(trainer: Pretrainer, folder: Path) -> None:
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from checkpoint.optimizer_state import states_by_parameter
    from modeling.registry import family_of

    topo, config, plan = trainer.topo, trainer.config, trainer.plan
    family = family_of(config)
    head = f"{family.skeleton.head}.weight"

    def piece(theirs: str, name: str, tensor: paddle.Tensor) -> ShardedWeight:
        axis, shape = trainer.axes.get(name), list(plan[name].shape)
        offset = [0] * len(shape)
        if axis is not None and list(tensor.shape) != shape:
            offset[axis] = topo.tp_rank * tensor.shape[axis]
        if name == head:  # PaddleFormers' LMHead keeps transformers' [vocab, hidden]
            tensor, shape, offset = tensor.T, shape[::-1], offset[::-1]
        return ShardedWeight(theirs, tensor, tuple(tensor.shape), tuple(shape), tuple(offset))

    params = trainer.raw_model.state_dict()
    their = {name: family.transformers.stored(name, plan[name], config).name for name in params}
    dist.save_state_dict({their[n]: piece(their[n], n, t) for n, t in params.items()}, str(folder / "model_state"))
    by_internal = {param.name: name for name, param in params.items()}
    states = {}
    for internal, held in states_by_parameter(trainer.optimizer).items():
        name = by_internal[internal]
        for state, tensor in held.items():
            key = f"{their[name]}.{state}_0"
            states[key] = piece(key, name, tensor) if tensor.shape == params[name].shape else \
                ShardedWeight(key, tensor, tuple(tensor.shape), tuple(tensor.shape), (0,) * len(tensor.shape))
    dist.save_state_dict(states, str(folder / "optimizer_state"))
    if topo.global_rank == 0:
        paddle.save(trainer.schedule.state_dict(), str(folder / "scheduler.pdparams"))
        paddle.save(_trainer_state_class()(global_step=trainer.step, consumed_samples=trainer.consumed_samples),
                    str(folder / "trainer_state.bin"))
    align_ranks(topo)


def main() -> int:
    folder, argv = Path(sys.argv[1]), sys.argv[2:]
    folder.mkdir(parents=True, exist_ok=True)
    trainer = Pretrainer(parse_args(argv))
    history = trainer.train()
    save_like_paddlenlp(trainer, folder)
    save_like_paddleformers(trainer, folder / "flex")
    after = trainer.train_one_step()
    write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in history],
                  "next_loss": after["loss"], "step": trainer.step})
    return end_job(trainer.topo)


if __name__ == "__main__":
    sys.exit(main())
