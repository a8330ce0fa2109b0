"""Optimizer states by parameter, whatever the optimizer: every accumulator it registered (Adam's
moments and beta powers, or any other) plus fp32 master weights under mixed precision.

States are classified generically: one shaped like its parameter splits like the parameter under
TP; any other shape (scalars, beta powers) is replicated.
"""

from __future__ import annotations

import paddle
from paddle.base import framework

MASTER_WEIGHT = "master_weight"


def inner_optimizer(optimizer) -> paddle.optimizer.Optimizer:
    """The Paddle optimizer inside fleet's hybrid and sharding wrappers (the one holding states)."""
    inner = optimizer
    while not isinstance(inner, paddle.optimizer.Optimizer):
        inner = getattr(inner, "_inner_opt", None)
        if inner is None:
            raise TypeError(f"{type(optimizer).__name__} wraps no paddle.optimizer.Optimizer")
    return inner


def local_parameters(optimizer) -> list:
    """Parameters this rank updates (sharding gives each rank its share)."""
    params = inner_optimizer(optimizer)._parameter_list
    if params and isinstance(params[0], dict):
        params = [p for group in params for p in group["params"]]
    return [p for p in params if not p.stop_gradient]


def ensure_states(optimizer) -> None:
    """Create the optimizer's states now (Paddle creates them lazily at the first step) so that a
    checkpoint can fill them before any step."""
    inner = inner_optimizer(optimizer)
    inner._create_accumulators(framework.default_main_program().global_block(), local_parameters(optimizer))


def states_by_parameter(optimizer) -> dict[str, dict[str, paddle.Tensor]]:
    """{parameter's internal name: {state name: tensor}} for the parameters this rank updates."""
    inner = inner_optimizer(optimizer)
    states: dict[str, dict[str, paddle.Tensor]] = {}
    for state_name, per_param in inner._accumulators.items():
        for param_name, tensor in per_param.items():
            states.setdefault(param_name, {})[state_name] = tensor
    for param_name, tensor in getattr(inner, "_master_weights", {}).items():
        states.setdefault(param_name, {})[MASTER_WEIGHT] = tensor
    return states


GRADIENT = "grad"


def record_gradients(optimizer) -> None:
    """Keep a copy of the gradients each update applies, as the innermost optimizer receives them:
    after the data-parallel and sharding reductions and the TP sync, before clipping. Alignment
    checks compare these across layouts; the copy costs one parameter-sized buffer per rank."""
    inner = inner_optimizer(optimizer)
    apply = inner._apply_optimize

    def recording(loss, startup_program, params_grads):
        inner._recorded_gradients = {p.name: g.detach().clone() for p, g in params_grads if g is not None}
        return apply(loss, startup_program, params_grads)

    inner._apply_optimize = recording
    inner._recorded_gradients = {}


def recorded_gradients(optimizer) -> dict[str, dict[str, paddle.Tensor]]:
    """{parameter's internal name: {"grad": tensor}} of the last update (shaped like `states_by_parameter`)."""
    return {name: {GRADIENT: grad} for name, grad in inner_optimizer(optimizer)._recorded_gradients.items()}
