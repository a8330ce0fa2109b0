"""Evaluation under DualPipeV, through its own schedule's forward-only pass.

Paddle 3.3.1's `DualPipeVParallel` has no `eval_batch`: the one it inherits from 1F1B runs the model
without the chunk ids its V needs. Its own `forward_backward_pipeline(forward_only=True)` runs the
V's forwards, but `_get_forward_inputs` empties an input's slot before returning it when
`forward_only` is set, so the first stage would run its first chunk on None. For the duration of one
evaluation, the model's `_get_forward_inputs` returns the input first and empties the slot after
(what forward-only means: nothing is kept for a backward). Its meta also describes only tensors that
take gradients (`SendRecvMeta._obtain_send_message` skips the others while every tensor is sent),
so under `no_grad` the first send fails its own check: the pass runs with gradients recorded, and
nothing calls backward on them (the graph goes with the losses at the schedule's end).

DualPipeV sends the shapes and dtypes of what stages exchange once, from the first stage at its
first send, and every stage builds its receive buffers from them after; an evaluation whose batch
differs from training's would receive into buffers of the wrong shape. So, as the 1F1B path clears
its meta cache around an evaluation (`step.eval_loss`), the meta is sent again before and after one.
"""

from __future__ import annotations

import types

import paddle


def dualpipev_eval_loss(model, data: list | None) -> paddle.Tensor:
    """The mean loss of the global batch `data` ([inputs, labels] on the first stage, None on the
    others) through DualPipeV's forward-only schedule; every stage receives it."""
    upstream = type(model)._get_forward_inputs

    def with_inputs(self, micro_datasets, phase: int, acc_id: int):
        self.forward_only = False
        try:
            inputs = upstream(self, micro_datasets, phase, acc_id)
        finally:
            self.forward_only = True
        self.input_tensors[phase][acc_id] = None
        return inputs

    model._get_forward_inputs = types.MethodType(with_inputs, model)
    _send_meta_again(model)
    try:
        with paddle.set_grad_enabled(True):
            return model.forward_backward_pipeline(data, None, forward_only=True).detach()
    finally:
        del model._get_forward_inputs
        _send_meta_again(model)


def _send_meta_again(model) -> None:
    """Make the next schedule send the exchange's meta from the first stage and receive it elsewhere
    (the state `DualPipeVParallel.__init__` leaves)."""
    model._p2p_helper.clear_meta_cache()
    model.need_broadcast_meta = model.is_pipeline_first_stage()
    model.need_recv_meta = not model.is_pipeline_first_stage()
