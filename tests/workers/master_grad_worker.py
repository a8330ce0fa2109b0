"""--amp_master_grad's bookkeeping on CPU: the trainer built in bf16 (as dtype_audit_worker.py builds
it), one training step of several micro-batches under `dtype_audit` (ops without a CPU bf16 kernel
run in fp32 with bf16 results, as a GPU's would be rounded).

Every parameter's bf16 gradient is recorded, widened to fp32, as each backward produces it (a hook
registered before fleet's main_grad hook, which adds it into the fp32 `main_grad` and clears it);
the gradients the optimizer receives are recorded as its update starts. Under sharding stage2 each
rank's micro-batch gradients are gathered too, since the owner's main_grad sums the group's.

argv: run_pretrain.py flags. Result: per parameter (by single-card name) the recorded micro-batch
gradients of every rank of the data group and the gradient the update received, as .npz files,
plus the ops that met mixed dtypes and the loss.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

from paddle_pp.runtime.lifetime import die_with_launcher


def main(argv: list[str]) -> int:
    import numpy as np
    from dtype_audit import dtype_audit

    from paddle_pp.runtime.fleet_wrappers import inner_optimizer
    from paddle_pp.runtime.launch import RESULT_DIR_ENV, write_result
    from paddle_pp.runtime.topology import gather_objects
    from paddle_pp.training import precision
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    precision.compute_dtype = lambda *_: "bfloat16"
    micro_batches: dict[str, list] = defaultdict(list)
    internal_names: dict[str, str] = {}
    accumulate_in_fp32 = precision.accumulate_in_fp32

    def recording_first(model, optimizer, dtype):
        for name, param in model.state_dict().items():
            internal_names[param.name] = name
            param._register_grad_hook(
                lambda grad, name=name: micro_batches[name].append(grad.astype("float32").numpy()) and None)
        return accumulate_in_fp32(model, optimizer, dtype)

    precision.accumulate_in_fp32 = recording_first
    trainer = Pretrainer(parse_args(argv))
    inner = inner_optimizer(trainer.optimizer)
    apply = inner._apply_optimize
    received: dict[str, np.ndarray] = {}

    def receiving(loss, startup_program, params_grads):
        received.update({internal_names[p.name.removeprefix("slice@")]: g.astype("float32").numpy()
                         for p, g in params_grads if g is not None})
        return apply(loss, startup_program, params_grads)

    inner._apply_optimize = receiving
    with dtype_audit() as mixed:
        record = trainer.train_one_step()
    topo = trainer.topo
    group, size = ((topo.sharding_group, topo.layout.sharding_degree) if topo.layout.sharding_degree > 1
                   else (None, 1))
    by_rank = gather_objects(dict(micro_batches), group, size)
    out = Path(os.environ[RESULT_DIR_ENV]) / f"rank{topo.global_rank}"
    np.savez(f"{out}.received.npz", **received)
    np.savez(f"{out}.micro.npz", **{f"{rank}/{name}/{i}": grad for rank, grads in enumerate(by_rank)
                                    for name, steps in grads.items() for i, grad in enumerate(steps)})
    write_result({"mixed": mixed, "loss": record["loss"], "files": str(out), "sharding_rank": topo.sharding_rank,
                  "parameter_dtypes": sorted({str(p.dtype) for p in trainer.raw_model.parameters()})})
    return 0


if __name__ == "__main__":
    die_with_launcher()
    sys.exit(main(sys.argv[1:]))
