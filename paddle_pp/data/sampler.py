"""Which samples each global batch holds: a pure function of (seed, consumed samples).

The training stream is an endless sequence of epochs, each a fresh permutation of the samples
drawn from `seed` and the epoch number. A run resumed at `consumed_samples` therefore reads exactly
what an uninterrupted run would, under any layout, and each data replica reads its own contiguous
slice of every global batch, so replicas are disjoint and together cover the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class GlobalBatchSampler:
    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self):
        if self.num_samples < 1:
            raise ValueError("the dataset holds no training samples")

    @lru_cache(maxsize=2)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch(self, consumed_samples: int) -> np.ndarray:
        """Sample indices of the global batch that starts after `consumed_samples`."""
        positions = np.arange(consumed_samples, consumed_samples + self.global_batch_size)
        return np.array([self._epoch_order(int(p // self.num_samples))[p % self.num_samples] for p in positions])

    def replica_batch(self, consumed_samples: int, replica: int, replicas: int) -> np.ndarray:
        """This data replica's slice of the global batch (replicas = dp x sharding)."""
        if self.global_batch_size % replicas:
            raise ValueError(f"global batch {self.global_batch_size} does not split over {replicas} data replicas")
        local = self.global_batch_size // replicas
        return self.global_batch(consumed_samples)[replica * local:(replica + 1) * local]
