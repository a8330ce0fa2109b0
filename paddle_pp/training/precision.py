"""Mixed precision: bf16/fp16 compute with fp32 master weights, driven as PaddleNLP's Trainer drives
Paddle's AMP (O2: low-precision parameters, fp32 masters in the optimizer, its autocast lists,
`GroupShardedScaler` under stage2/3, the schedule stepping only when the optimizer ran).

Paddle 3.3.1 on CPU has no bf16 matmul kernel and its AMP switches itself off there, so on CPU the
flags fail before anything starts instead of training in fp32 under a bf16 label. The bookkeeping
(`decorate`, the checkpoint's states) does not depend on the device and is tested on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import paddle

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout


class PrecisionError(UserError, ValueError):
    """Mixed precision requested where it is not available."""


# PaddleNLP's O2 lists: the embedding returns the compute dtype (Paddle's default O2 black list holds
# it, which keeps the residual stream and the pipeline's traffic in fp32), sums and the parallel
# cross entropy stay fp32.
WHITE_LIST = frozenset({"lookup_table", "lookup_table_v2"})
BLACK_LIST = frozenset({"reduce_sum", "c_softmax_with_cross_entropy"})


def compute_dtype(bf16: bool, fp16: bool, amp_master_grad: bool, layout: Layout) -> str | None:
    """'bfloat16', 'float16' or None (fp32), after checking the request makes sense for `layout` on
    its device."""
    if bf16 and fp16:
        raise PrecisionError("--bf16 and --fp16 are exclusive; pick one")
    if amp_master_grad and not (bf16 or fp16):
        raise PrecisionError("--amp_master_grad needs --bf16 or --fp16")
    if amp_master_grad and layout.cp > 1 and layout.group_sharded_level is not None:
        raise PrecisionError(
            f"--amp_master_grad with --context_parallel_degree {layout.cp} and --sharding {layout.sharding_stage} is "
            "not supported: the cp ranks' gradients are scaled as backward produces them, before they reach the "
            "fp32 main_grad (untested order); use --sharding stage1 with context parallelism, or drop one.")
    if amp_master_grad and layout.sharding_stage == "stage3":
        raise PrecisionError(
            "--amp_master_grad with --sharding stage3 is not supported: Paddle's stage3 reduces and slices each "
            "parameter's own gradient and has no path for the fp32 main_grad master gradients accumulate into "
            "(its stage2 has one, as does fleet's stage1). Use --sharding stage2 or stage1, or drop --amp_master_grad.")
    if not (bf16 or fp16):
        return None
    if layout.device == "cpu":
        raise PrecisionError(
            f"--{'bf16' if bf16 else 'fp16'} needs a GPU: Paddle {paddle.__version__} on CPU has no bf16 matmul "
            "kernel and its AMP O2 silently computes in fp32. Drop the flag to train in fp32 on CPU.")
    return "bfloat16" if bf16 else "float16"


def decorate(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer, dtype: str | None) -> None:
    """O2 in place: the model's parameters in `dtype`, the optimizer keeping fp32 master weights.
    These are the calls `paddle.amp.decorate(level="O2")` makes after its device check (which makes
    it a no-op on CPU), so the same bookkeeping runs in the CPU tests."""
    if dtype is None:
        return
    from paddle.amp.auto_cast import _set_multi_precision, amp_initialize

    amp_initialize(models=[model], dtype=dtype, excluded_layers=None)
    _set_multi_precision(optimizer, True)


def accumulate_in_fp32(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer, dtype: str) -> Any:
    """--amp_master_grad as PaddleNLP's Trainer drives fleet: every parameter's low-precision gradient
    is added into an fp32 `main_grad` as each backward produces it, and cleared (fleet's
    `MixPrecisionLayer`); the optimizer steps with the main grads (`MixPrecisionOptimizer`, which the
    layout's wrappers then wrap). Fleet's data-parallel and pipeline reductions, stage1 and stage2,
    its scalers and its hybrid clip read `main_grad` where a parameter has one, and so do this
    trainer's tp gradient sums and gradient recorder (they take what the optimizer receives).
    Paddle's own `decorate(master_grad=True)` casts a gradient to fp32 after a backward instead, and
    the next micro-batch's bf16 gradient cannot be added to it (Paddle fails at the second backward)."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

    MixPrecisionLayer(model, dtype=dtype)  # registers the hooks on `model`'s parameters; the wrapper itself is unused
    return MixPrecisionOptimizer(optimizer)


def autocast(dtype: str | None):
    """The forward's autocast context, for training and evaluation alike (a no-op in fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(level="O2", dtype=dtype, custom_white_list=set(WHITE_LIST),
                                custom_black_list=set(BLACK_LIST))


def loss_scaler(dtype: str | None, layout: Layout, initial_scale: float, master_grad: bool = False) -> Any:
    """Dynamic loss scaling for fp16 (bf16 has fp32's range and needs none), wrapped as PaddleNLP's
    Trainer wraps it. Under stage2/3 the scaler must first gather each rank's reduced gradient slice
    (`update_slice`) and check those for inf, which only `GroupShardedScaler` does; with TP, PP or
    stage1 fleet's scaler all-reduces the overflow flag over the job. On one card or pure data
    parallelism the plain scaler serves (the gradients are already equal on every replica), and
    fleet's would fail: it treats a single card as hybrid and all-reduces over a global group a
    one-process job never creates. Fleet's and the group-sharded scalers unscale `main_grad` where a
    parameter has one; the plain one learns to from fleet's `MixPrecisionScaler`, as in PaddleNLP."""
    if dtype != "float16":
        return None
    scaler = paddle.amp.GradScaler(init_loss_scaling=initial_scale)
    if layout.group_sharded_level is not None:
        from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedScaler

        return GroupShardedScaler(scaler)
    if layout.tp > 1 or layout.pp > 1 or layout.sharding_degree > 1:
        from paddle.distributed import fleet

        return fleet.distributed_scaler(scaler)
    if master_grad:
        from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionScaler

        MixPrecisionScaler(scaler)  # rebinds the scaler's unscale to read main_grad; the wrapper itself is unused
    return scaler


def optimizer_ran(scaler: Any) -> bool:
    """Whether the last step updated the weights: fp16 skips the update when a gradient overflowed."""
    return scaler is None or not bool(scaler._cache_found_inf)


def scaler_state(scaler: Any) -> dict:
    """The loss scaler's state as JSON values (the trainer state carries it, so a resume keeps the
    scale it had reached instead of starting again at --scale_loss)."""
    if scaler is None:
        return {}
    return {name: float(value.reshape(-1)[0]) if name == "scale" else value
            for name, value in scaler.state_dict().items()}


def restore_scaler(scaler: Any, state: dict) -> None:
    """Set `scaler` from `scaler_state` (nothing to do without one on either side)."""
    if scaler is not None and state:
        scaler.load_state_dict({**state, "scale": np.array([state["scale"]], np.float32)})
