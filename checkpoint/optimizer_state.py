"""Optimizer states by parameter, whatever the optimizer: every accumulator it registered (Adam's
moments and beta powers, or any other) plus fp32 master weights under mixed precision, and the
one rule for how a state splits under TP.
"""

from __future__ import annotations

import paddle
from paddle.base import framework
from paddle.base.framework import EagerParamBase

from paddle_pp.runtime.fleet_wrappers import inner_optimizer
from paddle_pp.runtime.stage3 import SLICE_PREFIX, is_sliced

MASTER_WEIGHT = "master_weight"


def state_tp_axis(state_shape, param_shape, param_axis: int | None) -> int | None:
    """A state shaped like its parameter (moments, master weights) splits like the parameter under
    TP; any other shape (scalars, beta powers) is replicated."""
    return param_axis if list(state_shape) == list(param_shape) else None


def local_parameters(optimizer) -> list:
    """Parameters this rank updates, as its optimizer names them. Stage1's optimizer lists only this
    rank's share; stage2's lists every parameter and updates those its `param2rank` gives this rank;
    stage3's updates a flat slice ("slice@<name>") of each large parameter (listed from its first
    step on; before it, stood in for by a parameter of the slice's name and shape)."""
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )

    params = inner_optimizer(optimizer)._parameter_list
    if params and isinstance(params[0], dict):
        params = [p for group in params for p in group["params"]]
    if isinstance(optimizer, GroupShardedOptimizerStage2):
        params = [p for p in params if optimizer.param2rank[p.name] == optimizer._rank]
    return [EagerParamBase(shape=p.fw_storage.shape, dtype=p.fw_storage.dtype, name=SLICE_PREFIX + p.name)
            if is_sliced(p) else p for p in params if not p.stop_gradient]


def ensure_states(optimizer) -> None:
    """Create the optimizer's states now (Paddle creates them lazily at the first step) so that a
    checkpoint can fill them before any step."""
    inner = inner_optimizer(optimizer)
    inner._create_accumulators(framework.default_main_program().global_block(), local_parameters(optimizer))


def states_by_parameter(optimizer) -> dict[str, dict[str, paddle.Tensor]]:
    """{parameter's internal name: {state name: tensor}} for the parameters this rank updates.

    Under mixed precision Paddle files a parameter's accumulators under its fp32 master weight's
    name, not the parameter's: `<param>_fp32_master_0`, or under stage3 (which makes the masters
    of its slices itself) the unsliced `<param>` for the slice `slice@<param>`. Keyed as filed,
    every moment of a bf16 run would be dropped from its checkpoints; so each key goes back to the
    parameter whose master it names."""
    inner = inner_optimizer(optimizer)
    masters = getattr(inner, "_master_weights", {})
    parameter_of = {master.name: param_name for param_name, master in masters.items()}
    states: dict[str, dict[str, paddle.Tensor]] = {}
    for state_name, per_param in inner._accumulators.items():
        for filed_under, tensor in per_param.items():
            states.setdefault(parameter_of.get(filed_under, filed_under), {})[state_name] = tensor
    for param_name, tensor in masters.items():
        states.setdefault(param_name, {})[MASTER_WEIGHT] = tensor
    return states
