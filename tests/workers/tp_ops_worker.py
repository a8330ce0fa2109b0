"""Runs each tensor-parallel op on its mp rank and reports outputs and input gradients.

argv: a case file (.npz) the test wrote; the test recomputes the same quantities in one plain
process from that case and compares.
Every op is driven the way fleet's layers drive it: an upstream gradient `grad_*` per rank where
the op's output is rank-local, one shared upstream gradient where it is replicated.
"""

from __future__ import annotations

import sys

import numpy as np


def _tensor(array, grad=True):
    import paddle

    t = paddle.to_tensor(array)
    t.stop_gradient = not grad
    return t


def _block(array, rank, tp, axis=-1):
    return np.split(array, tp, axis=axis)[rank]


def run(case_file: str) -> dict[str, list]:
    from paddle.distributed import collective
    from paddle.distributed.fleet.layers.mpu import mp_layers

    from modeling.blocks.norms import SplitRMSNorm
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import init_distributed

    case = dict(np.load(case_file))
    tp, ignore_index = len(case["parts"]), int(case["ignore_index"])
    topo = init_distributed(Layout(world_size=tp, tensor_parallel_degree=tp))
    group, rank = topo.tp_group, topo.tp_rank
    out: dict[str, list] = {}

    x = _tensor(case["x"])
    y = collective._c_identity(x, group=group)
    (y * _tensor(case["grad_blocks"][rank], False)).sum().backward()
    out["identity_fwd"], out["identity_grad"] = y.numpy().tolist(), x.grad.numpy().tolist()

    part = _tensor(case["parts"][rank])
    y = collective._mp_allreduce(part, group=group)
    (y * _tensor(case["grad_full"], False)).sum().backward()
    out["allreduce_fwd"], out["allreduce_grad"] = y.numpy().tolist(), part.grad.numpy().tolist()

    x = _tensor(case["x"])
    y = collective._c_split(x, group=group)
    (y * _tensor(_block(case["grad_full"], rank, tp), False)).sum().backward()
    out["split_fwd"], out["split_grad"] = y.numpy().tolist(), x.grad.numpy().tolist()

    local = _tensor(_block(case["x"], rank, tp))
    y = collective._c_concat(local, group=group)
    (y * _tensor(case["grad_full"], False)).sum().backward()
    out["concat_fwd"], out["concat_grad"] = y.numpy().tolist(), local.grad.numpy().tolist()

    embedding = mp_layers.VocabParallelEmbedding(case["table"].shape[0], case["table"].shape[1])
    embedding.weight.set_value(_block(case["table"], rank, tp, axis=0))
    y = embedding(_tensor(case["ids"], False))
    (y * _tensor(case["grad_full"], False)).sum().backward()
    out["embedding_fwd"], out["embedding_grad"] = y.numpy().tolist(), embedding.weight.grad.numpy().tolist()

    logits = _tensor(_block(case["logits"], rank, tp))
    loss = mp_layers.ParallelCrossEntropy(ignore_index=ignore_index)(logits, _tensor(case["labels"], False))
    (loss * _tensor(case["loss_weights"], False)).sum().backward()
    out["cross_entropy_fwd"], out["cross_entropy_grad"] = loss.numpy().tolist(), logits.grad.numpy().tolist()
    norm = SplitRMSNorm(case["x"].shape[-1], float(case["eps"]), group)
    norm.weight.set_value(_block(case["norm_weight"], rank, tp))
    x = _tensor(_block(case["x"], rank, tp))
    y = norm(x)
    (y * _tensor(_block(case["grad_full"], rank, tp), False)).sum().backward()
    out["split_norm_fwd"], out["split_norm_grad"] = y.numpy().tolist(), x.grad.numpy().tolist()
    out["split_norm_weight_grad"] = norm.weight.grad.numpy().tolist()
    out["tp_rank"] = rank
    return out


if __name__ == "__main__":
    from paddle_pp.runtime.launch import write_result

    write_result(run(sys.argv[1]))
