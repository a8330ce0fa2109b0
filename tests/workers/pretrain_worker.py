"""run_pretrain.py with one JSON result per rank for the test harness: the loss curve, grad norms,
eval loss, whether the rank built the dataset, what it held in memory right after its last
update (parameters, gradients, optimizer states: what sharding stage1-3 partition), and on a
resume whether it started from exactly the checkpoint's weights and optimizer states."""

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


def resumed_exactly(trainer) -> bool | None:
    """Whether every weight and optimizer state this rank holds (its tp piece; under stage1 the
    states of the parameters it updates) equals the checkpoint it resumed, before any step: the
    unified files' piece (weights saved with --save_to_hf read as a transformers folder's are), or a
    pre-split copy's rank file (None: not resumed)."""
    import numpy as np

    from checkpoint.format import MODEL, OPTIMIZER, STATE_SEPARATOR, weights_layout
    from checkpoint.optimizer_state import states_by_parameter
    from checkpoint.shards import ShardReader
    from checkpoint.split import is_split, rank_file
    from checkpoint.unified_io import UnifiedReader
    from paddle_pp.interop.pretrained import open_pretrained

    folder = trainer.resume_dir
    if folder is None:
        return None
    tp, tp_rank = trainer.layout.tp, trainer.topo.tp_rank
    whole = trainer.plan.whole_at(tp)  # key/value projections with fewer heads than tp ranks

    def piece(reader, key: str) -> np.ndarray:
        if isinstance(reader, ShardReader) or key.split(STATE_SEPARATOR)[0] in whole:  # held whole: a pre-split
            return reader.read(key).reshape(-1)  # copy's rank file holds this rank's pieces whole
        return reader.read(key, reader.piece(key, tp, tp_rank)).reshape(-1)

    if is_split(folder):
        weights, states = (ShardReader(folder / rank_file(kind, tp_rank, trainer.topo.pp_rank))
                           for kind in (MODEL, OPTIMIZER))
    else:
        weights, states = (None if weights_layout(folder) is not None else UnifiedReader(folder, MODEL),
                           UnifiedReader(folder, OPTIMIZER))
    if weights is None:
        pretrained = open_pretrained(folder)

        def saved_weight(name: str) -> np.ndarray:
            return pretrained.read(name, trainer.axes.get(name) if tp > 1 else None, tp, tp_rank).reshape(-1)
    else:
        def saved_weight(name: str) -> np.ndarray:
            return piece(weights, name)

    by_parameter = states_by_parameter(trainer.optimizer)
    pairs = [(param, saved_weight(name)) for name, param in trainer.raw_model.state_dict().items()]
    moments = [(tensor, piece(states, f"{name}{STATE_SEPARATOR}{state}"))
               for name, param in trainer.raw_model.state_dict().items()
               for state, tensor in by_parameter.get(param.name, {}).items()]
    return bool(moments) and all(np.array_equal(tensor.numpy().reshape(-1), value) for tensor, value in pairs + moments)


def main(argv: list[str]) -> int:
    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import cli

    held: dict[str, int] = {}
    resumed: dict[str, bool | None] = {}

    def record_held(trainer) -> None:
        held.update(held_elements(trainer))

    def record_resumed(trainer) -> None:
        resumed["exactly"] = resumed_exactly(trainer)

    def report(trainer, history: list[dict]) -> None:
        trained = [record for record in history if "loss" in record]
        write_result({"rank": trainer.topo.global_rank, "losses": [r["loss"] for r in trained],
                      "trained_steps": [r["step"] for r in trained], "grad_norms": [r["grad_norm"] for r in trained],
                      "tokens_per_sec": [r["tokens_per_sec"] for r in trained],
                      "aux_losses": [r.get("aux_loss") for r in trained],
                      "mtp_losses": [r.get("mtp_loss") for r in trained],
                      "indexer_losses": [r.get("indexer_loss") for r in trained],
                      "router_margins": [r.get("router_margin") for r in trained],
                      "expert_load": trained[-1].get("expert_load") if trained else None,
                      "eval_loss": history[-1].get("eval_loss") if history else None,
                      "eval_losses": {str(r["step"]): r["eval_loss"] for r in history if "eval_loss" in r},
                      "dataset_built": trainer.train_data is not None, "stage": trainer.topo.pp_rank,
                      "held_elements": held, "resumed_exactly": resumed.get("exactly")})

    return cli.main(argv, record_held, report, record_resumed)


if __name__ == "__main__":
    die_with_launcher()  # first, as run_pretrain.py does: a killed launcher takes its ranks along
    sys.exit(main(sys.argv[1:]))
