"""fp16's training loop with Paddle's own dynamic loss scaler, on CPU: the trainer keeps fp32
parameters (CPU has no fp16 kernels) and is handed the scaler `precision.loss_scaler` builds for
--fp16, constructed past `GradScaler`'s device check (on CPU it switches itself off), and its forward
runs under the trainer's real fp16 autocast, which CPU turns into O0 but which records fp16 as the
AMP dtype, without which the scaler disables itself at its first `scale()`. On the steps named, a
gradient hook turns the first parameter's gradient into inf/nan, what an fp16 overflow leaves;
Paddle's scaler then finds it, the optimizer skips the update and the scale halves, as on a GPU.
(An fp32 overflow cannot be provoked through the scale alone: a scale large enough makes its inverse
subnormal, and the unscaled gradients flush to zero.)

argv: the overflowing steps ("1,3"), then run_pretrain.py flags. Result: the step records, a checksum of the weights before training and
after every update, and the scaler's state once the trainer is built (after a resume, the restored
one) and at the end.
"""

from __future__ import annotations

import hashlib
import sys
from types import SimpleNamespace

from paddle_pp.runtime.lifetime import die_with_launcher


def _weights_checksum(model) -> str:
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    from paddle.amp import grad_scaler

    from paddle_pp.runtime.launch import write_result
    from paddle_pp.training import precision, step
    from paddle_pp.training.arguments import parse_args
    from paddle_pp.training.trainer import Pretrainer

    fp16_scaler = precision.loss_scaler

    def scaler_as_on_gpu(_dtype, layout, initial_scale, master_grad=False):
        tracer = grad_scaler._dygraph_tracer
        grad_scaler._dygraph_tracer = lambda: SimpleNamespace(
            _expected_place=SimpleNamespace(is_gpu_place=lambda: True))
        try:
            return fp16_scaler("float16", layout, initial_scale, master_grad)
        finally:
            grad_scaler._dygraph_tracer = tracer

    precision.loss_scaler = scaler_as_on_gpu
    step.autocast = lambda _dtype: precision.autocast("float16")
    overflowing = {int(s) for s in argv[0].split(",")}
    checksums: list[str] = []
    trainer = Pretrainer(parse_args(argv[1:]), after_update=lambda t: checksums.append(_weights_checksum(t.raw_model)))
    trainer.raw_model.parameters()[0].register_hook(
        lambda grad: grad * float("inf") if trainer.step + 1 in overflowing else grad)
    built_with = precision.scaler_state(trainer.scaler)
    before = _weights_checksum(trainer.raw_model)
    history = trainer.train()
    write_result({"history": history, "weights_before": before, "weights_after_update": checksums,
                  "scaler_built": built_with, "scaler_final": precision.scaler_state(trainer.scaler)})
    return 0


if __name__ == "__main__":
    die_with_launcher()
    sys.exit(main(sys.argv[1:]))
