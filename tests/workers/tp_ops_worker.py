"""Runs each tensor-parallel op on its mp rank and reports outputs and input gradients.

The test recomputes the same quantities in one plain process from `make_case` and compares.
Every op is driven the way fleet's layers drive it: an upstream gradient `grad_*` per rank where
the op's output is rank-local, one shared upstream gradient where it is replicated.
"""

from __future__ import annotations

import sys

import numpy as np

VOCAB_PER_RANK = 5
HIDDEN_PER_RANK = 3
IGNORE_INDEX = -100


def make_case(tp: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    batch, seq = 2, 3
    hidden, vocab = HIDDEN_PER_RANK * tp, VOCAB_PER_RANK * tp
    labels = rng.integers(0, vocab, size=(batch, seq)).astype("int64")
    labels[0, 1] = IGNORE_INDEX
    return {
        "x": rng.standard_normal((batch, seq, hidden)).astype("float32"),
        "parts": rng.standard_normal((tp, batch, seq, hidden)).astype("float32"),
        "grad_blocks": rng.standard_normal((tp, batch, seq, hidden)).astype("float32"),
        "grad_full": rng.standard_normal((batch, seq, hidden)).astype("float32"),
        "table": rng.standard_normal((vocab, hidden)).astype("float32"),
        "ids": rng.integers(0, vocab, size=(batch, seq)).astype("int64"),
        "logits": (3 * rng.standard_normal((batch, seq, vocab))).astype("float32"),
        "labels": labels,
        "loss_weights": rng.standard_normal((batch, seq, 1)).astype("float32"),
    }


def _tensor(array, grad=True):
    import paddle

    t = paddle.to_tensor(array)
    t.stop_gradient = not grad
    return t


def _block(array, rank, tp, axis=-1):
    return np.split(array, tp, axis=axis)[rank]


def run(tp: int) -> dict[str, list]:
    from paddle.distributed import collective
    from paddle.distributed.fleet.layers.mpu import mp_layers

    from paddle_pp.layout import Layout
    from paddle_pp.topology import init_distributed

    topo = init_distributed(Layout(world_size=tp, tensor_parallel_degree=tp))
    group, rank = topo.tp_group, topo.tp_rank
    case = make_case(tp)
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
    loss = mp_layers.ParallelCrossEntropy(ignore_index=IGNORE_INDEX)(logits, _tensor(case["labels"], False))
    (loss * _tensor(case["loss_weights"], False)).sum().backward()
    out["cross_entropy_fwd"], out["cross_entropy_grad"] = loss.numpy().tolist(), logits.grad.numpy().tolist()
    out["tp_rank"] = rank
    return out


if __name__ == "__main__":
    from paddle_pp.launch import write_result

    write_result(run(int(sys.argv[1])))
