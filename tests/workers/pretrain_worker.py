"""run_pretrain.py with one JSON result per rank for the test harness: the loss curve, grad norms,
eval loss, whether the rank built the dataset, and what it held in memory right after its last
update (parameters, gradients, optimizer states: what sharding stage1-3 partition)."""

from __future__ import annotations

import sys

from paddle_pp.runtime.lifetime import die_with_launcher


def held_elements(trainer) -> dict[str, int]:
    """Elements of parameters, gradients and optimizer states this rank holds. A stage3-sliced
    parameter counts its flat slice, and its gradient the slice the optimizer stepped with plus the
    buffer it was reduced into (both alive until the gradients are cleared); stage2 has released
    the gradients of parameters other ranks update."""
    from checkpoint.optimizer_state import states_by_parameter
    from paddle_pp.runtime.stage3 import is_sliced

    params = trainer.raw_model.parameters()
    grads = [p.grad for p in params] + [t for p in params if is_sliced(p) for t in (p.fw_storage.grad, p.bw_storage)]
    buffers = {g.data_ptr(): int(g.size) for g in grads if g is not None and g._is_initialized()}  # shared once
    return {"parameters": sum(int(p.fw_storage.size) if is_sliced(p) else int(p.size) for p in params),
            "whole_parameters": sum(int(p.size) for p in params if not is_sliced(p)),
            "gradients": sum(buffers.values()),
            "optimizer_states": sum(int(t.size) for states in states_by_parameter(trainer.optimizer).values()
                                    for t in states.values())}


def main(argv: list[str]) -> int:
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import cli

    held: dict[str, int] = {}

    def record_held(trainer) -> None:
        held.update(held_elements(trainer))

    def report(trainer, history: list[dict]) -> None:
        trained = [record for record in history if "loss" in record]
        write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in trained],
                      "trained_steps": [r["step"] for r in trained], "grad_norms": [r["grad_norm"] for r in trained],
                      "tokens_per_sec": [r["tokens_per_sec"] for r in trained],
                      "aux_losses": [r.get("aux_loss") for r in trained],
                      "router_margins": [r.get("router_margin") for r in trained],
                      "expert_load": trained[-1].get("expert_load") if trained else None,
                      "eval_loss": history[-1].get("eval_loss") if history else None,
                      "dataset_built": trainer.train_data is not None, "stage": trainer.topo.pp_rank,
                      "held_elements": held})

    return cli.main(argv, record_held, report)


if __name__ == "__main__":
    die_with_launcher()  # first, as run_pretrain.py does: a killed launcher takes its ranks along
    sys.exit(main(sys.argv[1:]))
