"""Regions the model computes in fp32 whatever the compute dtype: norm statistics, the attention
softmax, the loss and the rotary tables. Under O2 autocast Paddle runs every op outside its black
list in bf16/fp16, including these; PaddleNLP's LLaMA turns autocast off around them, and so do we."""

from __future__ import annotations

import contextlib

import paddle


def full_precision():
    """Autocast off for the block inside; nothing to do (and no cost) when autocast is not on."""
    if not paddle.amp.is_autocast_enabled():
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(False)
