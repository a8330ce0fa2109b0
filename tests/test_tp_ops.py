"""Each CPU tensor-parallel op, forward and backward, equals the single-process computation (rtol 1e-6):
fleet's communication ops, its vocab-parallel embedding and cross entropy, and our RMSNorm over a
vector split over tp (OLMoE's q/k norms)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.blocks.norms import RMSNorm

pytestmark = pytest.mark.multiproc

VOCAB_PER_RANK = 5
HIDDEN_PER_RANK = 3
IGNORE_INDEX = -100
EPS = 1e-5

RTOL = 1e-6
ATOL = 1e-6  # absolute floor for entries that are sums of O(1) terms cancelling to near zero


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
        "norm_weight": (1 + 0.5 * rng.standard_normal(hidden)).astype("float32"),
    }


def _grad(fn, *arrays):
    """Value of fn(*tensors) and the gradient of its first input, in one plain process."""
    tensors = [paddle.to_tensor(a) for a in arrays]
    tensors[0].stop_gradient = False
    value, loss = fn(*tensors)
    loss.backward()
    return value.numpy(), tensors[0].grad.numpy()


def reference(case: dict, tp: int, rank: int) -> dict[str, np.ndarray]:
    def block(a, axis=-1):
        return np.split(a, tp, axis=axis)[rank]

    ref = {
        "identity_fwd": case["x"], "identity_grad": case["grad_blocks"].sum(0),
        "allreduce_fwd": case["parts"].sum(0), "allreduce_grad": case["grad_full"],
        "split_fwd": block(case["x"]), "split_grad": case["grad_full"],
        "concat_fwd": case["x"], "concat_grad": block(case["grad_full"]),
    }
    emb, emb_grad = _grad(
        lambda table, ids, g: (lambda y: (y, (y * g).sum()))(paddle.nn.functional.embedding(ids, table)),
        case["table"], case["ids"], case["grad_full"],
    )
    ref["embedding_fwd"], ref["embedding_grad"] = emb, block(emb_grad, axis=0)

    def cross_entropy(logits, labels, weights):
        loss = paddle.nn.functional.cross_entropy(
            logits, labels.unsqueeze(-1), reduction="none", ignore_index=IGNORE_INDEX)
        return loss, (loss * weights).sum()

    ce, ce_grad = _grad(cross_entropy, case["logits"], case["labels"], case["loss_weights"])
    ref["cross_entropy_fwd"], ref["cross_entropy_grad"] = ce, block(ce_grad)

    norm = RMSNorm(case["x"].shape[-1], EPS)
    norm.weight.set_value(case["norm_weight"])
    normed, norm_grad = _grad(lambda x, g: (lambda y: (y, (y * g).sum()))(norm(x)), case["x"], case["grad_full"])
    ref["split_norm_fwd"], ref["split_norm_grad"] = block(normed), block(norm_grad)
    ref["split_norm_weight_grad"] = block(norm.weight.grad.numpy())
    return ref


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ops_match_single_process(run_workers, tmp_path, tp):
    case = make_case(tp)
    np.savez(tmp_path / "case.npz", ignore_index=IGNORE_INDEX, eps=EPS, **case)
    results = run_workers("tp_ops_worker.py", tp, [tmp_path / "case.npz"], timeout=180)
    assert sorted(r["tp_rank"] for r in results) == list(range(tp))
    for result in results:
        expected = reference(case, tp, result["tp_rank"])
        for key, want in expected.items():
            np.testing.assert_allclose(
                np.asarray(result[key]), want, rtol=RTOL, atol=ATOL,
                err_msg=f"{key} on tp rank {result['tp_rank']} of {tp}",
            )
