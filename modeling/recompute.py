"""Activation recompute for one decoder block, with the guard pipeline schedules need."""

from __future__ import annotations

from typing import Callable

import paddle
from paddle.distributed.fleet.utils import recompute


def maybe_recompute(block: Callable[[paddle.Tensor], paddle.Tensor], hidden: paddle.Tensor, enabled: bool,
                    training: bool) -> paddle.Tensor:
    """Recompute `block` in backward when enabled, non-reentrant, and only when the input carries a
    gradient: reentrant recompute on a stop_gradient pipeline input hangs the schedule (PaddleNLP#7235)."""
    if enabled and training and not hidden.stop_gradient:
        return recompute(block, hidden, use_reentrant=False)
    return block(hidden)
