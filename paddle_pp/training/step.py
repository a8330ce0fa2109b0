"""One optimizer step or one evaluation over a global batch, the same call for every layout.

The pipeline runs its own schedule (`train_batch`/`eval_batch`); otherwise micro-batches are
accumulated here with the loss scaled by 1/accumulate_steps, which is what the pipeline's mean over
micro-batches computes, so both paths give the single-card mean loss.
"""

from __future__ import annotations

from typing import Callable

import paddle
import paddle.distributed as dist

from paddle_pp.runtime.dualpipev_eval import dualpipev_eval_loss
from paddle_pp.runtime.topology import Topology
from paddle_pp.training.precision import autocast


def replica_slice(batch_size: int, topo: Topology) -> slice:
    """This rank's rows of a global batch: dp x sharding replicas read disjoint, equal slices."""
    if batch_size % topo.data_replica_count:
        raise ValueError(f"global batch {batch_size} does not split over {topo.data_replica_count} data replicas")
    local = batch_size // topo.data_replica_count
    return slice(topo.data_replica_index * local, (topo.data_replica_index + 1) * local)


def _data_groups(topo: Topology) -> list[tuple[object, int]]:
    """(group, size) of the dp and sharding groups with more than one rank (a group of one is never looked
    up: a single card may run without fleet)."""
    return [(getattr(topo, group), size) for group, size in (("dp_group", topo.layout.dp),
                                                              ("sharding_group", topo.layout.sharding_degree))
            if size > 1]


def mean_over_replicas(value: paddle.Tensor, topo: Topology) -> float:
    """Average a replica-local scalar over dp and sharding ranks, so every rank reports the global
    value; under context parallelism each cp rank's loss is its part of its replica's, summed first."""
    value = value.detach().astype("float32").reshape([])
    if topo.ring is not None:
        value = topo.ring.all_reduce(value)
    for group, size in _data_groups(topo):
        value = value.clone()
        dist.all_reduce(value, group=group)
        value = value / size
    return float(value)


def replicas_sum(count: int, topo: Topology) -> int:
    """A replica-local count summed over the dp and sharding ranks (one all-reduce per group)."""
    total = paddle.to_tensor([count], dtype="int64")
    for group, _ in _data_groups(topo):
        dist.all_reduce(total, group=group)
    return int(total.item())


def micro_batch(inputs, part: slice):
    """Rows `part` of the inputs: the ids, or (ids, positions inside each sample) of packed rows."""
    return tuple(x[part] for x in inputs) if isinstance(inputs, tuple) else inputs[part]


def train_step(model, optimizer, criterion, inputs, labels, topo: Topology, accumulate_steps: int,
               compute_dtype: str | None = None, scaler=None, after_update: Callable[[], None] | None = None) -> float:
    """Forward, backward and update on this replica's slice; returns the global mean loss.
    `after_update` runs after the update, before gradients are cleared (the pipeline clears them
    inside its schedule: there it runs after).

    Middle pipeline stages pass `inputs = labels = None`: they only relay activations."""
    if topo.layout.pp > 1:
        with autocast(compute_dtype):
            loss = model.train_batch([inputs, labels], optimizer, scaler=scaler)
        if after_update:
            after_update()
        return mean_over_replicas(loss, topo)
    micro = (inputs[0] if isinstance(inputs, tuple) else inputs).shape[0] // accumulate_steps
    total = paddle.zeros([])
    for m in range(accumulate_steps):
        part = slice(m * micro, (m + 1) * micro)
        with autocast(compute_dtype):
            loss = criterion(model(micro_batch(inputs, part)), labels[part]) / accumulate_steps
        (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach().astype("float32")
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if after_update:
        after_update()
    optimizer.clear_grad()
    return mean_over_replicas(total, topo)


def eval_loss(model, criterion, inputs, labels, topo: Topology, compute_dtype: str | None = None) -> float:
    """Mean loss without an update, under the training's autocast (the model's parameters are in
    the compute dtype, so evaluating without it mixes dtypes). The pipeline's p2p meta cache
    (`p2p_cache_shape`) is cleared before and after, as PaddleNLP does: train and eval share it, and
    evaluation sends activations of another dtype and without gradients, whose cached meta would
    make the next `train_batch` skip sending gradients back, hanging the first stage. The model is
    in eval mode meanwhile on every layout (fleet's `eval_batch` sets it under pp): no dropout, and
    an MoE layer's routing is not counted into the step's expert loads."""
    model.eval()
    with paddle.no_grad(), autocast(compute_dtype):
        if topo.layout.pp == 1:
            loss = criterion(model(inputs), labels)
        elif topo.layout.dualpipev:
            loss = dualpipev_eval_loss(model, [inputs, labels] if topo.is_first_stage else None)
        else:
            model._p2p_helper.clear_meta_cache()
            loss = model.eval_batch([inputs, labels], compute_loss=True)
            model._p2p_helper.clear_meta_cache()
    model.train()
    return mean_over_replicas(loss, topo)
