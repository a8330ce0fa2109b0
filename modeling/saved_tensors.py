"""What our PyLayers keep for backward inside a recomputed region.

Paddle 3.3.1's non-reentrant recompute (`fleet.utils.recompute(..., use_reentrant=False)`, what
`--recompute` runs) gives a PyLayer's backward wrong values for a tensor it saved
(`ctx.save_for_backward`) when that tensor is a strided view: the saved view comes back read as if
its storage were contiguous (a PyLayer squaring a transposed [2, 3, 4] view: gradients 5.6 off;
Paddle's own ops are not affected). Under sequence parallelism with micro-batches of more than one
sequence, the attention core's q, k and v are such views ([seq, batch, heads, dim] cut from
[batch, seq, ...] buffers), so recomputing attention trained wrongly (grad norm 1.2146 against
1.2126 at the first step of the test model, tp2 + SP). Inside a region that is recomputed, a strided
tensor is therefore saved as a contiguous copy (`kept`); outside one, tensors are saved as they are,
so what a run keeps for backward without recompute is unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import paddle

_REGIONS = [0]  # how many recomputed regions the running code is inside (its forward or its recomputation)


@contextmanager
def recomputed_region() -> Iterator[None]:
    """Mark the code inside as running in a region `--recompute` recomputes."""
    _REGIONS[0] += 1
    try:
        yield
    finally:
        _REGIONS[0] -= 1


def kept(*tensors: paddle.Tensor | None) -> tuple[paddle.Tensor | None, ...]:
    """`tensors` to hand `ctx.save_for_backward`: strided ones as contiguous copies inside a recomputed region."""
    if not _REGIONS[0]:
        return tensors
    return tuple(t.contiguous() if t is not None and not t.is_contiguous() else t for t in tensors)
