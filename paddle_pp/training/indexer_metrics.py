"""A sparse-attention run's metric: its indexers' KL loss (unweighted), the mean over every layer and
micro-batch of the step (Megatron logs the same beside the language-model loss, which it leaves out of
the logged `loss`; here too the logged loss is the language model's). Each layer call records its own
(`Execution.indexers`); once per step they are averaged over the job (`job_mean`)."""

from __future__ import annotations

from modeling.blocks.decoder import token_mixers
from modeling.indexer_training import IndexerTraining
from paddle_pp.runtime.topology import Topology
from paddle_pp.training.prediction_metrics import job_mean


def indexer_metrics(training: IndexerTraining, config, topo: Topology) -> dict:
    """{"indexer_loss": ...} for a model with sparse attention (a collective over pp, dp and sharding:
    every rank calls it once per step), {} otherwise."""
    if not has_indexers(config):
        return {}
    mean = job_mean(training.losses, topo)
    return {"indexer_loss": mean} if mean is not None else {}


def has_indexers(config) -> bool:
    return any(getattr(mixer, "indexer", None) is not None for index in range(config.num_hidden_layers)
               for mixer in token_mixers(config.decoder_layer(index)))
