"""Build the trainer as run_pretrain.py would (resuming a checkpoint), train nothing, and print
what it resumed as JSON: step, data position, schedule, and whether the weights equal the
checkpoint's and the optimizer states a fresh optimizer's or the checkpoint's.

argv: run_pretrain.py flags (with --resume_from_checkpoint)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import paddle

from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR
from checkpoint.optimizer_state import ensure_states, states_by_parameter
from checkpoint.unified_io import UnifiedReader
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer


def main() -> None:
    args = parse_args(sys.argv[1:])
    trainer = Pretrainer(args)
    folder = Path(args.checkpoint.resume_from_checkpoint)
    weights, saved_states = UnifiedReader(folder, MODEL), UnifiedReader(folder, OPTIMIZER)
    fresh = paddle.optimizer.AdamW(parameters=trainer.raw_model.parameters(), beta1=args.optim.adam_beta1,
                                   beta2=args.optim.adam_beta2)
    ensure_states(trainer.optimizer)
    ensure_states(fresh)
    resumed, new = states_by_parameter(trainer.optimizer), states_by_parameter(fresh)
    equal_fresh, equal_saved = [], []
    for name, param in trainer.raw_model.state_dict().items():
        for state, tensor in resumed[param.name].items():
            equal_fresh.append(np.array_equal(tensor.numpy(), new[param.name][state].numpy()))
            equal_saved.append(np.array_equal(tensor.numpy().reshape(-1),
                                              saved_states.read(f"{name}{STATE_SEPARATOR}{state}").reshape(-1)))
    print(json.dumps({
        "step": trainer.step, "consumed_samples": trainer.consumed_samples,
        "schedule_step": trainer.schedule.last_epoch,
        "weights_equal_checkpoint": all(np.array_equal(p.numpy(), weights.read(n))
                                        for n, p in trainer.raw_model.state_dict().items()),
        "states_equal_fresh": all(equal_fresh), "states_equal_checkpoint": all(equal_saved)}))


if __name__ == "__main__":
    main()
