"""How a run trains sparse attention's indexers (DeepSeek-V3.2's two stages), read by every indexed
layer: the indexer loss's weight (`--indexer_loss_coef`), whether the run is in the dense warm-up
(`--indexer_dense_warmup_steps`: every earlier key attended, only the indexers learn) or the sparse stage
(each query's selected keys, everything learns), and each layer call's indexer loss for the metrics.
Lives apart from the blocks so the run's `Execution` can carry it; the trainer switches the stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IndexerTraining:
    coef: float = 1.0  # --indexer_loss_coef
    dense: bool = False  # in the dense warm-up
    losses: list = field(default_factory=list)  # each training call's indexer loss (unweighted)
