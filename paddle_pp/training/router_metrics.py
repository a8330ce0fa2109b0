"""A mixture-of-experts run's routing in the metrics: the aux loss (summed over layers, as it is
added to the objective) and each sparse layer's expert load, the same numbers on every rank
whatever the layout.

Each rank's layers record what they routed (`modeling.router_stats.RouterStats`); once per step
one table of [layers, 1 + experts] (the layer's mean aux loss, then the tokens each expert received)
is summed over the pipeline stages (each holds its own layers) and over the data ranks (each routed
its own samples), the aux column then divided by the data ranks to a mean (`step_routing`); the
balancing rule reads its loads and the metrics the whole (`router_metrics`). Tensor-parallel ranks
route the same tokens and are not summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.distributed as dist

from modeling.router_stats import RouterStats
from paddle_pp.runtime.topology import Topology
from paddle_pp.training.expert_balance import balanced_layers


@dataclass(frozen=True)
class StepRouting:
    """One step's routing over the whole job: per layer [aux loss summed over the data replicas, then
    the tokens each expert received], and the least router margin. The balancing rule and the metrics
    both read it, so the loads cross the ranks once per step."""

    table: np.ndarray  # [layers, 1 + experts], float64 (sums of integer counts: exact)
    margin: float

    @property
    def loads(self) -> np.ndarray:
        return self.table[:, 1:]


def step_routing(stats: RouterStats, config, topo: Topology) -> StepRouting | None:
    """What every rank's MoE layers routed since the last call, summed over the pipeline stages (each
    holds its own layers) and the data and sharding ranks (each routed its own samples); None for a
    dense model. A collective over pp, dp, sharding, cp and (under SP) tp: every rank calls it once per step."""
    if not getattr(config, "num_experts", 0):
        return None
    aux, load, margin = stats.take()
    table = np.zeros([_layers(config), 1 + config.num_experts])
    for layer, values in aux.items():
        table[layer, 0] = float(np.mean([float(value) for value in values]))
    for layer, counts in load.items():
        table[layer, 1:] = counts.numpy()
    table, least = paddle.to_tensor(table, "float64"), paddle.to_tensor([margin], "float64")
    for group, size in (("pp_group", topo.layout.pp), ("dp_group", topo.layout.dp),
                        ("sharding_group", topo.layout.sharding_degree)):
        if size > 1:
            dist.all_reduce(table, group=getattr(topo, group))
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=getattr(topo, group))
    # the loads are pooled over the ranks sharing each sequence already (each layer's), the margins are each rank's
    if topo.ring is not None:
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=topo.ring.group)
    if topo.layout.sequence_parallel and topo.layout.tp > 1:
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=topo.tp_group)
    return StepRouting(table.numpy(), float(least))


def router_metrics(routing: StepRouting | None, config, topo: Topology, model: paddle.nn.Layer | None = None) -> dict:
    """{"aux_loss": ..., "aux_loss_by_layer": each sparse layer's, "expert_load": per sparse layer, each
    expert's share of its routed tokens, "router_margin": the least gap between a token's k-th and
    (k+1)-th choice this step (a gap near fp32 noise lets another layout route that token elsewhere),
    and with correction biases "correction_bias": per layer its [min, max] after this step's update}
    (empty for a dense model). With correction biases under pp, a collective over pp."""
    if routing is None:
        return {}
    biases = np.zeros([_layers(config), 2])
    for layer in balanced_layers(model) if model is not None else []:
        correction = layer.router_layer.correction
        biases[layer.layer_index] = [float(correction.min()), float(correction.max())]
    corrected = _corrected(config)
    if corrected and topo.layout.pp > 1:  # each stage holds its own layers' biases, the same on every data rank
        held = paddle.to_tensor(biases, "float64")
        dist.all_reduce(held, group=topo.pp_group)
        biases = held.numpy()
    table, replicas = routing.table, topo.layout.dp * topo.layout.sharding_degree
    routed = table[:, 1:].sum(axis=1)
    sparse = np.flatnonzero(routed)
    metrics = {"aux_loss": float(table[:, 0].sum() / replicas), "router_margin": routing.margin,
               "aux_loss_by_layer": {str(layer): float(table[layer, 0] / replicas) for layer in sparse},
               "expert_load": {str(layer): [round(float(share), 6) for share in table[layer, 1:] / routed[layer]]
                               for layer in sparse}}
    if corrected:
        metrics["correction_bias"] = {str(layer): [float(value) for value in biases[layer]] for layer in sparse}
    return metrics


def _layers(config) -> int:
    """Rows of the routing tables: the decoder layers, then the multi-token prediction layers (numbered on)."""
    return config.num_hidden_layers + config.mtp_depth


def _corrected(config) -> bool:
    """Whether the model's routers carry correction biases (the same answer on every rank)."""
    routings = [getattr(config.decoder_layer(i).feed_forward, "routing", None) for i in range(_layers(config))]
    return any(routing is not None and routing.correction_bias for routing in routings)
