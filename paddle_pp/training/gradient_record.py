"""A copy of the gradients each update applies, for alignment checks (`--save_gradients`): taken
as the innermost optimizer receives them, after the data-parallel and sharding reductions and the
TP sync, before clipping. The copy costs one parameter-sized buffer per rank."""

from __future__ import annotations

import paddle

from paddle_pp.runtime.fleet_wrappers import inner_optimizer

GRADIENT = "grad"


def record_gradients(optimizer) -> None:
    """Wrap the inner optimizer's `_apply_optimize` (Paddle 3.3.1; see docs/paddle-internals.md, "Paddle internals
    we replace") so every update leaves its gradients behind."""
    inner = inner_optimizer(optimizer)
    apply = inner._apply_optimize

    def recording(loss, startup_program, params_grads):
        inner._recorded_gradients = {p.name: g.detach().clone() for p, g in params_grads if g is not None}
        return apply(loss, startup_program, params_grads)

    inner._apply_optimize = recording
    inner._recorded_gradients = {}


def recorded_gradients(optimizer) -> dict[str, dict[str, paddle.Tensor]]:
    """{parameter's internal name: {"grad": tensor}} of the last update (shaped like
    `checkpoint.optimizer_state.states_by_parameter`, so the checkpoint saves it as a kind)."""
    return {name: {GRADIENT: grad} for name, grad in inner_optimizer(optimizer)._recorded_gradients.items()}
