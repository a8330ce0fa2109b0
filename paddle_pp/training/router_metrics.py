"""A mixture-of-experts run's routing in the metrics: the aux loss (summed over layers, as it is
added to the objective) and each sparse layer's expert load, the same numbers on every rank
whatever the layout.

Each rank's layers record what they routed (`modeling.router_stats.RouterStats`); one table of
[layers, 1 + experts] (the layer's mean aux loss, then the tokens each expert received) is summed
over the pipeline stages (each holds its own layers) and over the data ranks (each routed its own
samples), the aux column then divided by the data ranks to a mean. Tensor-parallel ranks route the
same tokens and are not summed.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist

from modeling.router_stats import RouterStats
from paddle_pp.runtime.topology import Topology
from paddle_pp.training.expert_balance import balanced_layers


def routing_table(stats: RouterStats, num_layers: int, num_experts: int) -> tuple[np.ndarray, float]:
    """This rank's [layers, 1 + experts] table since the last call (rows of layers it does not hold
    zero), and its least router margin."""
    aux, load, margin = stats.take()
    table = np.zeros([num_layers, 1 + num_experts])
    for layer, values in aux.items():
        table[layer, 0] = float(np.mean([float(value) for value in values]))
    for layer, counts in load.items():
        table[layer, 1:] = counts.numpy()
    return table, margin


def router_metrics(stats: RouterStats, config, topo: Topology, model: paddle.nn.Layer | None = None) -> dict:
    """{"aux_loss": ..., "aux_loss_by_layer": each sparse layer's, "expert_load": per sparse layer, each
    expert's share of its routed tokens, "router_margin": the least gap between a token's k-th and
    (k+1)-th choice this step (a gap near fp32 noise lets another layout route that token elsewhere),
    and with correction biases "correction_bias": per layer its [min, max] after this step's update}
    (empty for a dense model). A collective over pp, dp and sharding: every rank calls it each step."""
    if not getattr(config, "num_experts", 0):
        return {}
    table, margin = routing_table(stats, config.num_hidden_layers, config.num_experts)
    biases = np.zeros([config.num_hidden_layers, 2])
    for layer in balanced_layers(model) if model is not None else []:
        correction = layer.router_layer.correction
        biases[layer.layer_index] = [float(correction.min()), float(correction.max())]
    table, margin = paddle.to_tensor(table, "float64"), paddle.to_tensor([margin], "float64")
    biases = paddle.to_tensor(biases, "float64")
    replicas = topo.layout.dp * topo.layout.sharding_degree
    for group, size in (("pp_group", topo.layout.pp), ("dp_group", topo.layout.dp),
                        ("sharding_group", topo.layout.sharding_degree)):
        if size > 1:
            dist.all_reduce(table, group=getattr(topo, group))
            dist.all_reduce(margin, op=dist.ReduceOp.MIN, group=getattr(topo, group))
    if topo.layout.pp > 1:  # each stage holds its own layers' biases, the same on every data rank
        dist.all_reduce(biases, group=topo.pp_group)
    table, biases = table.numpy(), biases.numpy()
    routed = table[:, 1:].sum(axis=1)
    sparse = np.flatnonzero(routed)
    metrics = {"aux_loss": float(table[:, 0].sum() / replicas), "router_margin": float(margin),
               "aux_loss_by_layer": {str(layer): float(table[layer, 0] / replicas) for layer in sparse},
               "expert_load": {str(layer): [round(float(share), 6) for share in table[layer, 1:] / routed[layer]]
                               for layer in sparse}}
    if _corrected(config):
        metrics["correction_bias"] = {str(layer): [float(value) for value in biases[layer]] for layer in sparse}
    return metrics


def _corrected(config) -> bool:
    """Whether the model's routers carry correction biases (the same answer on every rank)."""
    routings = [getattr(config.decoder_layer(i).feed_forward, "routing", None) for i in range(config.num_hidden_layers)]
    return any(routing is not None and routing.correction_bias for routing in routings)
