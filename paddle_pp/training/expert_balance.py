"""DeepSeek-V3's aux-loss-free balancing (its paper, section 2.1.2): after each optimizer step, each
mixture-of-experts layer's correction bias moves by rate x sign(mean(c) - c), c the tokens each of
its experts received over the whole global batch of the step (every micro-batch, every data and
sharding rank; expert-parallel ranks are data ranks, each routing its own tokens; tensor-parallel
ranks route the same tokens and count once; a recomputed forward is not counted again: modeling.
execution.recomputing). Overloaded experts lose bias and underloaded ones gain it, so selection
drifts towards balance without a loss term.

The bias is an fp32 buffer of the router (`blocks.router.RouterLayer`): outside the optimizer (no
moments, no weight decay, no clipping), moved identically on every rank holding the layer (the same
summed integer counts, the same fp32 arithmetic), saved and resharded under its single-card name
(`mlp.gate.e_score_correction_bias`). `--moe_router_bias_update_rate 0` freezes it, as continued
training of a released checkpoint wants (Pai-Megatron-Patch#467).
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from modeling.blocks.moe import SparseMoE
from modeling.router_stats import RouterStats
from paddle_pp.runtime.topology import Topology


def balanced_layers(model: paddle.nn.Layer) -> list[SparseMoE]:
    """This rank's MoE layers whose routers carry a correction bias, in model order."""
    return [layer for layer in model.sublayers() if isinstance(layer, SparseMoE) and layer.router_layer.correction is not None]


def step_counts(layers: list[SparseMoE], stats: RouterStats, topo: Topology) -> paddle.Tensor:
    """[layers, experts] fp32: the tokens each expert of each of `layers` received this step, summed
    over the data and sharding ranks (read without clearing: the metrics read them too)."""
    counts = paddle.stack([stats.load[layer.layer_index].astype("float32") for layer in layers])
    for group, size in ((topo.dp_group, topo.layout.dp), (topo.sharding_group, topo.layout.sharding_degree)):
        if size > 1:
            dist.all_reduce(counts, group=group)
    return counts


def update_correction_biases(model: paddle.nn.Layer, stats: RouterStats, topo: Topology, rate: float) -> None:
    """Move every correction bias this rank holds by the rule (a collective over dp and sharding)."""
    layers = balanced_layers(model)
    if not layers or rate == 0:
        return
    counts = step_counts(layers, stats, topo)
    moves = rate * paddle.sign(counts.mean(axis=-1, keepdim=True) - counts)
    with paddle.no_grad():
        for layer, move in zip(layers, moves):
            layer.router_layer.correction.set_value(layer.router_layer.correction + move)
