"""No fp32 subnormal reaches a product or a sum inside the attention cores: Paddle's CPU exp leaves
them for -inf (every masked score) and for scores more than 87 nats under their row's maximum, and
Intel CPUs compute on them ~100x slower (paddle_pp/runtime/normal_range.py). Each case spreads its
scores over more than 90 nats and every masked kind is present; the test records each fp32 operand of
`paddle.matmul` and each tensor summed while the core runs forward and backward, so it fails on any
CPU if a core leaves one (it does with the flush removed: the premise is checked first)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from modeling.attention_core import CORES
from modeling.attention_core.ring import _merge
from modeling.attention_core.spec import CoreSpec
from modeling.documents import Documents
from paddle_pp.runtime.normal_range import SMALLEST_NORMAL, exp_normal, flush_subnormals_, subnormal_count

SEQ, HEADS, KV_HEADS, HEAD_DIM = 96, 4, 2, 16
BLOCK = 32  # three query blocks: diagonal, edge and off-diagonal blocks all met


class Operands:
    """Records subnormals among the fp32 operands of `paddle.matmul` and of `Tensor.sum`."""

    def __init__(self, monkeypatch):
        self.found: list[tuple[str, int]] = []
        self.calls = 0
        matmul, total = paddle.matmul, paddle.Tensor.sum

        def recorded(name, t):
            self.calls += 1
            if isinstance(t, paddle.Tensor) and t.dtype == paddle.float32 and subnormal_count(t):
                self.found.append((name, subnormal_count(t)))

        def checked_matmul(x, y, *args, **kwargs):
            recorded("matmul", x)
            recorded("matmul", y)
            return matmul(x, y, *args, **kwargs)

        def checked_sum(t, *args, **kwargs):
            recorded("sum", t)
            return total(t, *args, **kwargs)

        monkeypatch.setattr(paddle, "matmul", checked_matmul)
        monkeypatch.setattr(paddle.Tensor, "sum", checked_sum)


def _spread_inputs(seed: int = 0):
    """q, k, v whose scores span over 90 nats within each row (keys of very different norms)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, SEQ, HEADS, HEAD_DIM)).astype(np.float32) * 3.0
    k = rng.standard_normal((1, SEQ, KV_HEADS, HEAD_DIM)).astype(np.float32)
    k *= rng.uniform(0.1, 12.0, (1, SEQ, KV_HEADS, 1)).astype(np.float32)
    v = rng.standard_normal((1, SEQ, KV_HEADS, HEAD_DIM)).astype(np.float32)
    tensors = [paddle.to_tensor(t) for t in (q, k, v)]
    for t in tensors:
        t.stop_gradient = False
    return tensors


def _score_spread(q, k) -> float:
    scores = np.einsum("bqhd,bkhd->bhqk", q.numpy()[:, :, ::HEADS // KV_HEADS], k.numpy()) / np.sqrt(HEAD_DIM)
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    return float(np.max(np.where(causal, scores, -np.inf).max(-1) - np.where(causal, scores, np.inf).min(-1)))


def test_paddles_exp_leaves_subnormals_that_the_flush_sets_to_zero():
    """The premise, on this Paddle: its CPU exp gives 2^-128 for -inf and subnormals below -87.3 on
    tensors of 8 or more, and the flush makes exactly those 0 while every normal value stays."""
    arguments = paddle.to_tensor(np.array([-np.inf, -1e30, -100.0, -88.0, -87.0, -10.0, 0.0, 1.0], np.float32))
    assert subnormal_count(paddle.exp(arguments)) >= 4
    flushed, raw = exp_normal(arguments).numpy(), paddle.exp(arguments).numpy()
    assert list(flushed[:4]) == [0.0] * 4
    assert SMALLEST_NORMAL <= flushed[4] and abs(flushed[4] - raw[4]) <= 2.0 ** -125  # exp(-87), normal: kept
    np.testing.assert_array_equal(flushed[5:], raw[5:])
    values = np.array([1e-39, -1e-39, 5e-45, SMALLEST_NORMAL, 3e-24, -0.5, 1.0, 7e20], np.float32)
    out = flush_subnormals_(paddle.to_tensor(values)).numpy()
    np.testing.assert_array_equal(out[:3], 0.0)
    assert out[3] >= SMALLEST_NORMAL or out[3] == 0.0
    np.testing.assert_array_equal(out[4:], values[4:])


SPECS = {
    "causal": (CoreSpec(), False, False),
    "window": (CoreSpec(window=20), False, False),
    "softcap_alibi": (CoreSpec(softcap=50.0, alibi=(0.5, 0.25, 0.125, 0.0625)), False, False),
    "sinks": (CoreSpec(), True, False),
    "documents": (CoreSpec(documents=True), False, True),
}


@pytest.mark.parametrize("case", list(SPECS))
@pytest.mark.parametrize("core", ["blockwise", "dense"])
def test_no_subnormal_reaches_a_product_or_a_sum(monkeypatch, core, case):
    spec, with_sinks, by_document = SPECS[case]
    q, k, v = _spread_inputs()
    assert _score_spread(q, k) > 90
    sinks = paddle.to_tensor(np.array([95.0, -95.0, 0.0, 3.0], np.float32)) if with_sinks else None
    if sinks is not None:
        sinks.stop_gradient = False
    documents = None
    if by_document:  # documents of 40, 30 and 26 tokens
        positions = np.concatenate([np.arange(40), np.arange(30), np.arange(26)])[None]
        documents = Documents.of(paddle.to_tensor(positions), None)
    attention = CORES["blockwise"].__class__(block=BLOCK) if core == "blockwise" else CORES["dense"]
    upstream = paddle.to_tensor(np.random.default_rng(1).standard_normal((1, SEQ, HEADS * HEAD_DIM)).astype(np.float32))
    operands = Operands(monkeypatch)
    out = attention(q, k, v, False, spec, sinks, documents)
    paddle.autograd.backward([out], [upstream])
    assert operands.calls > 0
    assert operands.found == [], f"{core} {case}: subnormal operands {operands.found[:5]}"
    for t in (out, q.grad, k.grad, v.grad):
        assert subnormal_count(t) == 0 and bool(paddle.isfinite(t).all())


def test_the_ring_merge_leaves_no_subnormal():
    """Two partial results whose log-sum-exps differ by more than 87 nats, and a row that saw no key
    (-inf): the weights of the smaller part are exactly 0 (2^-128 without the flush, so a dominant
    part of 0 came out subnormal)."""
    rng = np.random.default_rng(2)
    out, part = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(2))
    out[:, :, 0::4], part[:, :, 1::4] = 0.0, 0.0  # the dominant part is 0 where the other is 100 nats under
    out, part = paddle.to_tensor(out), paddle.to_tensor(part)
    lse = paddle.to_tensor(rng.uniform(-5, 5, (1, 2, 16, 1)).astype(np.float32))
    part_lse = lse - paddle.to_tensor(np.array([100.0, -100.0, np.inf, 0.0] * 4, np.float32).reshape(1, 1, 16, 1))
    merged, merged_lse = _merge(out, lse, part, part_lse)
    assert subnormal_count(merged) == 0 and subnormal_count(merged_lse) == 0
    np.testing.assert_array_equal(merged.numpy()[:, :, 0::4], out.numpy()[:, :, 0::4])  # part 100 nats under
    np.testing.assert_array_equal(merged.numpy()[:, :, 1::4], part.numpy()[:, :, 1::4])  # out 100 nats under
    np.testing.assert_array_equal(merged.numpy()[:, :, 2::4], out.numpy()[:, :, 2::4])  # the part saw no key
