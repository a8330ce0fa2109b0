"""Build the trainer as run_pretrain.py would, resuming a checkpoint, in bf16 or fp32, and save
at once: the mixed-precision bookkeeping (parameters cast to bf16, fp32 master weights, Adam's
states filed under the masters' names, the checkpoint's load and save of all of them) under a real
layout, without a training step, which CPU cannot compute in bf16.

argv: bf16|fp32, perturb|keep, then run_pretrain.py flags (with --resume_from_checkpoint and a new
--output_dir). With `perturb` (TP + stage2/3), tp rank 1 first adds 1 to every tensor of its replicated
parameters (weights, masters, states) and the trainer's replicated sync runs before the save.
With --save_gradients in bf16, the gradient recorder is handed what a bf16 backward would give it,
bf16 tensors shaped like the parameters (copies of them, as CPU cannot run that backward).

In bf16 the one stand-in is `precision.compute_dtype`, which refuses bf16 on CPU because CPU cannot
compute it; everything after (decorate, wrappers, optimizer states, load, save) is the trainer's own.
"""

from __future__ import annotations

import sys

from paddle_pp.runtime.lifetime import die_with_launcher


def main(argv: list[str]) -> int:
    from checkpoint.optimizer_state import MASTER_WEIGHT, ensure_states, states_by_parameter
    from paddle_pp.runtime.fleet_wrappers import inner_optimizer
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import precision
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.replicated_sync import replicated_tensors, sync_replicated
    from paddle_pp.training.trainer import Pretrainer

    mode, perturb, flags = argv[0], argv[1] == "perturb", argv[2:]
    if mode == "bf16":
        precision.compute_dtype = lambda *_: "bfloat16"
    args = parse_args(flags)
    trainer = Pretrainer(args)
    if mode == "bf16" and args.checkpoint.save_gradients:
        inner_optimizer(trainer.optimizer)._recorded_gradients = {
            p.name: p.detach().clone() for p in trainer.raw_model.parameters()}
    ensure_states(trainer.optimizer)
    states = states_by_parameter(trainer.optimizer)
    if perturb:
        if trainer.topo.tp_rank == 1:
            for tensor in replicated_tensors(trainer.raw_model, trainer.optimizer, trainer.axes):
                tensor.set_value((tensor.astype("float32") + 1.0).astype(tensor.dtype))
        sync_replicated(trainer.raw_model, trainer.optimizer, trainer.axes, trainer.topo)
    trainer.save()
    trainer.finish_pending_save()
    write_result({"parameter_dtypes": sorted({str(p.dtype) for p in trainer.raw_model.parameters()}),
                  "masters": sum(MASTER_WEIGHT in held for held in states.values()),
                  "moments": sum("moment1" in held for held in states.values())})
    return 0


if __name__ == "__main__":
    die_with_launcher()
    sys.exit(main(sys.argv[1:]))
