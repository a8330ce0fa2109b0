"""A multi-token prediction run's metric: the prediction layers' loss, unweighted and averaged over
depths (Megatron logs it beside the language-model loss; the logged `loss` is the objective, the
next-token loss plus lambda times this). The criterion records each micro-batch's depth losses
(`Execution.prediction_losses`) on the last pipeline stage only; once per step they are summed with
their count over the pipeline stages and the data and sharding ranks, so every rank reports the
same global mean. Under cp each rank's losses are its part of its replica's: summed over the ring
first. Tensor-parallel ranks compute the same losses and are not summed.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from paddle_pp.runtime.topology import Topology


def prediction_metrics(recorded: list, config, topo: Topology) -> dict:
    """{"mtp_loss": ...} for a model with prediction layers (a collective over cp, pp, dp and sharding:
    every rank calls it once per step), {} otherwise; `recorded` is emptied."""
    if not config.mtp_depth:
        return {}
    mean = job_mean(recorded, topo)
    return {"mtp_loss": mean} if mean is not None else {}


def job_mean(recorded: list, topo: Topology) -> float | None:
    """The mean of what every rank recorded (None if none did), `recorded` emptied: summed with its count
    over the pipeline stages and the data and sharding ranks; under cp each rank's values are its part of
    its replica's, summed over the ring first. Tensor-parallel ranks record the same values and are not
    summed. A collective: every rank calls it at the same point."""
    losses = paddle.to_tensor(sum(float(loss) for loss in recorded), "float64")
    if topo.ring is not None:  # each cp rank's loss is its part of the replica's (as `step.mean_over_replicas`)
        losses = topo.ring.all_reduce(losses)
    total = paddle.stack([losses, paddle.to_tensor(len(recorded), "float64")])
    recorded.clear()
    for group, size in (("pp_group", topo.layout.pp), ("dp_group", topo.layout.dp),
                        ("sharding_group", topo.layout.sharding_degree)):
        if size > 1:
            dist.all_reduce(total, group=getattr(topo, group))
    loss, count = total.numpy().tolist()
    return loss / count if count else None
