"""Mixed precision: bf16/fp16 compute with fp32 master weights, refused where it cannot be real.

Paddle 3.3.1 on CPU has no bf16 matmul kernel and its AMP O2 silently keeps fp32 there, so on
CPU the flags fail before anything starts instead of training in fp32 under a bf16 label.
"""

from __future__ import annotations

import contextlib

import paddle

from paddle_pp.runtime.errors import UserError


class PrecisionError(UserError, ValueError):
    """Mixed precision requested where it is not available."""


def compute_dtype(bf16: bool, fp16: bool, amp_master_grad: bool, device: str) -> str | None:
    """'bfloat16', 'float16' or None (fp32), after checking the request makes sense on `device`."""
    if bf16 and fp16:
        raise PrecisionError("--bf16 and --fp16 are exclusive; pick one")
    if amp_master_grad and not (bf16 or fp16):
        raise PrecisionError("--amp_master_grad needs --bf16 or --fp16")
    if not (bf16 or fp16):
        return None
    if device == "cpu":
        raise PrecisionError(
            f"--{'bf16' if bf16 else 'fp16'} needs a GPU: Paddle {paddle.__version__} on CPU has no bf16 matmul "
            "kernel and its AMP O2 silently computes in fp32. Drop the flag to train in fp32 on CPU.")
    return "bfloat16" if bf16 else "float16"


def decorate(model, optimizer, dtype: str | None, master_grad: bool):
    """O2 mixed precision: low-precision parameters for compute, fp32 master copies in the optimizer."""
    if dtype is None:
        return model, optimizer
    return paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=dtype,
                               master_weight=True, master_grad=master_grad)


def autocast(dtype: str | None):
    """The forward's autocast context (a no-op in fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(level="O2", dtype=dtype)


def loss_scaler(dtype: str | None):
    """Dynamic loss scaling for fp16 (bf16 has fp32's range and needs none)."""
    if dtype != "float16":
        return None
    from paddle.distributed import fleet

    return fleet.distributed_scaler(paddle.amp.GradScaler(init_loss_scaling=2.0**15))
