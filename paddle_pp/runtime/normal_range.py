"""fp32 subnormal numbers kept out of the products and sums the cores compute.

Paddle 3.3.1's CPU `exp`, vectorised for tensors of 8 elements or more, returns 2^-128 (2.94e-39, a
subnormal) for -inf and for every argument below about -88.7, and true subnormals down from -87.3
(numpy gives 0 and the subnormal): the masked half of every diagonal block of the blockwise core and
every score more than 87 nats under its row's maximum became subnormal probabilities, half of such a
block. Intel CPUs compute on subnormals through microcode assists: a matmul of [1, 3, 1536, 512] by
[1, 3, 512, 64] takes 1.8 ms on normal probabilities and 163 ms when half are subnormal (Xeon,
AVX-512); AMD EPYC pays next to nothing, which is why no CPU benchmark of ours showed it
(`bench/denormals.py` measures what a CPU pays). Paddle 3.3.1 has no flush-to-zero mode (no flag,
no API; the MXCSR of its threads is never set), so the cores flush the tensors they make.

`flush_subnormals_` sets every value of magnitude under 2^-126 (the smallest normal fp32) to exactly
0 in place, as (x + 2^-102) - 2^-102: 2^-102's spacing is 2^-125, so anything under 2^-126 rounds to
it and subtracts to 0, the result is never subnormal, and every value above 2^-78 comes back bit for
bit (values between move by less than 2^-125, far under any probability's fp32 rounding). Two
in-place scale ops: 0.67 ms on [1, 3, 1536, 512] against 6.3 ms for the `exp` before them and 8.7 ms
for `hardshrink` (which allocates; Paddle's in-place elementwise ops do not).
"""

from __future__ import annotations

import paddle

SMALLEST_NORMAL = 2.0 ** -126
SHIFT = 2.0 ** -102  # its spacing, 2^-125, is the smallest normal step above 2^-126


def flush_subnormals_(t: paddle.Tensor) -> paddle.Tensor:
    """`t` (fp32) with every |x| < 2^-126 set to 0, in place; returned for chaining."""
    return t.scale_(1.0, SHIFT).scale_(1.0, -SHIFT)


def flush_subnormals(t: paddle.Tensor) -> paddle.Tensor:
    """`flush_subnormals_` out of place: for tensors autograd still needs (an `exp`'s output, which
    its backward reads), where the in-place form would fail the backward's version check."""
    return (t + SHIFT) - SHIFT


def exp_normal(x: paddle.Tensor) -> paddle.Tensor:
    """exp(x) with the results under the normal range (arguments below about -87.3, -inf among them)
    exactly 0, where Paddle's CPU exp leaves subnormals."""
    return flush_subnormals_(paddle.exp(x))


def subnormal_count(t: paddle.Tensor) -> int:
    """How many values of an fp32 tensor are subnormal (non-zero, under 2^-126 in magnitude)."""
    magnitude = paddle.abs(t)
    return int(paddle.logical_and(magnitude > 0, magnitude < SMALLEST_NORMAL).astype("int64").sum())
