"""Which samples each global batch holds: a pure function of the consumed-sample count.

The dataset is already shuffled (causal.py), so global batch k is samples [k*G, (k+1)*G) in
order, as PaddleNLP's run_pretrain reads them (its DistributedBatchSampler, shuffle off). Each data
replica reads its own contiguous slice of the global batch, so replicas are disjoint, together
cover the batch, and a run resumed at `consumed_samples` reads exactly what an uninterrupted run
would, under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paddle_pp.data.errors import DataError


@dataclass(frozen=True)
class SequentialBatches:
    num_samples: int
    global_batch_size: int

    def global_batch(self, consumed_samples: int) -> np.ndarray:
        """Sample indices of the global batch that starts after `consumed_samples`."""
        end = consumed_samples + self.global_batch_size
        if end > self.num_samples:
            raise DataError(f"the training dataset holds {self.num_samples} samples (built for --max_steps x global "
                            f"batch) but step needs samples up to {end}; raise --max_steps so the dataset is built "
                            "larger")
        return np.arange(consumed_samples, end)

    def replica_batch(self, consumed_samples: int, replica: int, replicas: int) -> np.ndarray:
        """This data replica's slice of the global batch (replicas = dp x sharding)."""
        if self.global_batch_size % replicas:
            raise DataError(f"global batch {self.global_batch_size} does not split over {replicas} data replicas")
        local = self.global_batch_size // replicas
        return self.global_batch(consumed_samples)[replica * local:(replica + 1) * local]
