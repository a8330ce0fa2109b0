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

import numpy as np
import paddle

from modeling.blocks.moe import SparseMoE


def balanced_layers(model: paddle.nn.Layer) -> list[SparseMoE]:
    """This rank's MoE layers whose routers carry a correction bias, in model order."""
    return [layer for layer in model.sublayers() if isinstance(layer, SparseMoE) and layer.router_layer.correction is not None]


def update_correction_biases(model: paddle.nn.Layer, loads: np.ndarray, rate: float) -> None:
    """Move every correction bias this rank holds by the rule, from `loads` [layers, experts]: the
    tokens each expert received this step over the whole job (`router_metrics.step_routing`, exact
    integer sums, so the same fp32 moves on every rank)."""
    layers = balanced_layers(model)
    if not layers or rate == 0:
        return
    counts = paddle.to_tensor(loads[[layer.layer_index for layer in layers]], "float32")
    moves = rate * paddle.sign(counts.mean(axis=-1, keepdim=True) - counts)
    with paddle.no_grad():
        for layer, move in zip(layers, moves):
            layer.router_layer.correction.set_value(layer.router_layer.correction + move)
