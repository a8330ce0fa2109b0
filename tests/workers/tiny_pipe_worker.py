"""A tiny ColumnParallel/RowParallel model inside fleet's `PipelineLayer`, trained a few AdamW steps.

Every rank loads its tensor-parallel slice of one deterministic single-card weight set, and every
data replica reads its slice of one deterministic global batch, so any layout must reproduce the
single-process losses. Run with `python tiny_pipe_worker.py` for the single-process reference or
under `paddle.distributed.launch` with layout flags.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.layers.mpu import mp_layers
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

from paddle_pp.runtime.fleet_wrappers import wrap_model, wrap_optimizer
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.layout import Layout, add_layout_args
from paddle_pp.runtime.topology import Topology, end_job, init_distributed
from paddle_pp.training.step import replica_slice, train_step

VOCAB, HIDDEN, FFN, LAYERS, SEQ = 32, 8, 16, 4, 6
GLOBAL_BATCH = 8


def full_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (0.3 * rng.standard_normal(shape)).astype("float32")

    weights = {"embed.weight": normal(VOCAB, HIDDEN), "head.weight": normal(HIDDEN, VOCAB)}
    for i in range(LAYERS):
        weights |= {
            f"blocks.{i}.fc1.weight": normal(HIDDEN, FFN), f"blocks.{i}.fc1.bias": normal(FFN),
            f"blocks.{i}.fc2.weight": normal(FFN, HIDDEN), f"blocks.{i}.fc2.bias": normal(HIDDEN),
        }
    return weights


def _load_slice(param, full: np.ndarray, axis: int | None) -> None:
    """Copy this tp rank's slice of `full` along `axis` (None: replicated) into `param`."""
    if axis is not None:
        hcg = fleet.get_hybrid_communicate_group()
        full = np.split(full, hcg.get_model_parallel_world_size(), axis=axis)[hcg.get_model_parallel_rank()]
    param.set_value(full)


class Embed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = mp_layers.VocabParallelEmbedding(VOCAB, HIDDEN)
        _load_slice(self.embed.weight, full_weights()["embed.weight"], axis=0)

    def forward(self, ids):
        return self.embed(ids)


class Block(nn.Layer):
    def __init__(self, index: int):
        super().__init__()
        self.fc1 = mp_layers.ColumnParallelLinear(HIDDEN, FFN, has_bias=True, gather_output=False)
        self.fc2 = mp_layers.RowParallelLinear(FFN, HIDDEN, has_bias=True, input_is_parallel=True)
        w = full_weights()
        _load_slice(self.fc1.weight, w[f"blocks.{index}.fc1.weight"], axis=1)
        _load_slice(self.fc1.bias, w[f"blocks.{index}.fc1.bias"], axis=0)
        _load_slice(self.fc2.weight, w[f"blocks.{index}.fc2.weight"], axis=0)
        _load_slice(self.fc2.bias, w[f"blocks.{index}.fc2.bias"], axis=None)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Head(nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = mp_layers.ColumnParallelLinear(HIDDEN, VOCAB, has_bias=False, gather_output=False)
        _load_slice(self.proj.weight, full_weights()["head.weight"], axis=1)

    def forward(self, x):
        return self.proj(x)


class VocabLoss(nn.Layer):
    """Mean token cross-entropy over vocab-split logits (plain cross-entropy when unsplit)."""

    def __init__(self, tp: int):
        super().__init__()
        self.parallel = mp_layers.ParallelCrossEntropy() if tp > 1 else None

    def forward(self, logits, labels):
        if self.parallel is not None:
            return self.parallel(logits, labels).mean()
        return F.cross_entropy(logits, labels.unsqueeze(-1)).mean()


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(1000 + step).integers(0, VOCAB, size=(GLOBAL_BATCH, SEQ + 1))
    return tokens[:, :-1].astype("int64"), tokens[:, 1:].astype("int64")


def train(layout: Layout, steps: int, accumulate_steps: int) -> tuple[dict, Topology]:
    micro_batch = GLOBAL_BATCH // layout.data_replicas // accumulate_steps
    topo = init_distributed(layout, micro_batch_size=micro_batch, accumulate_steps=accumulate_steps)
    layers = [LayerDesc(Embed), *[LayerDesc(Block, i) for i in range(LAYERS)], LayerDesc(Head)]
    loss_fn = VocabLoss(layout.tp)
    model = PipelineLayer(layers=layers, loss_fn=loss_fn, num_stages=layout.pp,
                          topology=topo.hcg.topology(), seg_method="layer:Block")
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(),
                                       grad_clip=nn.ClipGradByGlobalNorm(1.0))
    model = wrap_model(model, topo)
    optimizer = wrap_optimizer(optimizer)
    losses = []
    for step in range(steps):
        inputs, labels = global_batch(step)
        rows = replica_slice(GLOBAL_BATCH, topo)
        x, y = paddle.to_tensor(inputs[rows]), paddle.to_tensor(labels[rows])
        losses.append(train_step(model, optimizer, loss_fn, x, y, topo, accumulate_steps))
    return {"losses": losses, "rank": topo.global_rank, "coords": topo.coordinates()}, topo


def main(argv: list[str]) -> None:
    parser = add_layout_args(argparse.ArgumentParser())
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate_steps", type=int, default=2)
    args = parser.parse_args(argv)
    result, topo = train(Layout.from_args(args), args.steps, args.accumulate_steps)
    if result["rank"] == 0:
        print("losses:", " ".join(f"{loss:.6f}" for loss in result["losses"]))
    write_result(result)
    end_job(topo)


if __name__ == "__main__":
    main(sys.argv[1:])
