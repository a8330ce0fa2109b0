"""Keeping the parameters every TP rank holds whole identical under sharding stage2/3.

With TP, norms, biases and position embeddings are replicated over the tp group. On GPU their
gradients can differ in the last bits between tp ranks (non-deterministic reduction kernels), and
the copies then drift apart; the checkpoint's replica check would abort a save. Fleet's
`HybridParallelOptimizer` broadcasts them from the first tp rank after each step (`mp_configs`
`sync_param`, which `topology.build_strategy` turns on), but stage2 and stage3 replace that optimizer
with Paddle's group-sharded one, which knows nothing of TP. So under stage2/3 the trainer does the
same broadcast itself: each replicated parameter (its stage3 slice where sliced), its fp32 master
weight and every optimizer state this rank holds for it.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from checkpoint.optimizer_state import states_by_parameter
from paddle_pp.runtime.stage3 import is_sliced, slice_param_name
from paddle_pp.runtime.topology import Topology


def needs_replicated_sync(topo: Topology) -> bool:
    """Only stage2/3 with TP lack fleet's sync; CPU kernels are deterministic, but the broadcast is
    cheap (the replicated tensors are vectors) and keeps one code path for every device."""
    return topo.layout.tp > 1 and topo.layout.group_sharded_level is not None


def replicated_tensors(model: paddle.nn.Layer, optimizer, axes: dict) -> list[paddle.Tensor]:
    """The tensors to broadcast, in the same order on every tp rank (by structured name): each
    replicated parameter as this rank holds it, then its optimizer states."""
    states = states_by_parameter(optimizer)
    tensors = []
    for name, param in sorted(model.state_dict().items()):
        if axes.get(name) is not None or param.stop_gradient:
            continue
        tensors.append(param.fw_storage if is_sliced(param) else param)
        held = states.get(slice_param_name(param), {})
        tensors.extend(held[state] for state in sorted(held))
    return tensors


def sync_replicated(model: paddle.nn.Layer, optimizer, axes: dict, topo: Topology) -> None:
    """Broadcast the replicated tensors from the tp group's first rank (after an update)."""
    group = topo.tp_group
    for tensor in replicated_tensors(model, optimizer, axes):
        dist.broadcast(tensor, src=group.ranks[0], group=group)
