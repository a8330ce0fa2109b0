"""Learning-rate schedule: linear warmup to the peak, then cosine (or linear) decay to `min_learning_rate`."""

from __future__ import annotations

import math

from paddle.optimizer.lr import LRScheduler

DECAYS = {"cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)), "linear": lambda progress: 1 - progress}


class WarmupCosine(LRScheduler):
    """`last_epoch` counts optimizer steps, so `state_dict()` resumes the schedule exactly. `decay`
    "linear" is PaddleNLP's default (`--lr_scheduler_type`), "cosine" ours. The run's plan keeps the
    warmup within the steps (`run_plan.warmup_steps`)."""

    def __init__(self, learning_rate: float, warmup_steps: int, max_steps: int, min_learning_rate: float = 0.0,
                 decay: str = "cosine", warmup_from_zero: bool = False):
        self.warmup_steps, self.max_steps, self.min_learning_rate = warmup_steps, max_steps, min_learning_rate
        self.warmup_offset = 0 if warmup_from_zero else 1  # the first step's share of the peak: 0 or 1 / warmup
        self.decay = DECAYS[decay]
        super().__init__(learning_rate=learning_rate)

    def get_lr(self) -> float:
        step = self.last_epoch
        if step < self.warmup_steps:
            return self.base_lr * (step + self.warmup_offset) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_learning_rate + (self.base_lr - self.min_learning_rate) * self.decay(progress)
