"""A dtype audit that runs on CPU, where Paddle 3.3.1 has no bf16 kernel for most ops (matmul, add,
softmax, silu, ...). Every op called through `paddle._C_ops`, and the tensor-tensor arithmetic
operators (rerouted to those ops), first has its floating inputs' dtypes recorded; it then runs as
it is or, where CPU has no bf16 kernel, in fp32 with its results rounded back to bf16 (as a GPU's
bf16 matmul accumulates in fp32 and rounds its output). Backward follows the same ops.

CPU's autocast stays at O0, so what the audit sees is the model's own dtype flow: an op meeting
bf16 and fp32 inputs here is one that a GPU either refuses (matmul) or silently promotes to fp32
(elementwise ops) wherever autocast does not cast for it (evaluation before the fix, and the fp32
regions that turn autocast off).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import paddle

FLOATS = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)
OPERATORS = {"__add__": "add", "__radd__": "add", "__sub__": "subtract", "__rsub__": "subtract",
             "__mul__": "multiply", "__rmul__": "multiply", "__truediv__": "divide", "__rtruediv__": "divide"}
REFLECTED = ("__rsub__", "__rtruediv__")


def _tensors(values) -> Iterator[paddle.Tensor]:
    for value in values:
        if isinstance(value, paddle.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _mapped(values, fn: Callable[[paddle.Tensor], paddle.Tensor]):
    if isinstance(values, paddle.Tensor):
        return fn(values)
    if isinstance(values, (list, tuple)):
        return type(values)(_mapped(value, fn) for value in values)
    return values


@contextlib.contextmanager
def dtype_audit() -> Iterator[list[tuple[str, list[str]]]]:
    """Yields the list, filled while the block runs, of (op, its floating input dtypes) for every
    op call whose floating inputs differ in dtype."""
    mixed: list[tuple[str, list[str]]] = []
    ops = {name: getattr(paddle._C_ops, name) for name in dir(paddle._C_ops)
           if not name.startswith("_") and callable(getattr(paddle._C_ops, name))}
    cast = ops["cast"]

    def audited(name: str, op: Callable) -> Callable:
        def run(*args, **kwargs):
            dtypes = {tensor.dtype for tensor in _tensors(args) if tensor.dtype in FLOATS}
            if len(dtypes) > 1:
                mixed.append((name, sorted(str(dtype) for dtype in dtypes)))
            try:
                return op(*args, **kwargs)
            except (NotImplementedError, RuntimeError, ValueError) as error:
                if paddle.bfloat16 not in dtypes or "bfloat16" not in str(error):
                    raise
            wide = _mapped(list(args), lambda t: cast(t, paddle.float32) if t.dtype == paddle.bfloat16 else t)
            return _mapped(op(*wide, **kwargs),
                           lambda t: cast(t, paddle.bfloat16) if t.dtype == paddle.float32 else t)
        return run

    def rerouted(dunder: str, name: str) -> Callable:
        original = getattr(paddle.Tensor, dunder)

        def operator(x, y):
            if not isinstance(y, paddle.Tensor):  # a Python scalar: Paddle's scale op, which has bf16 kernels
                return original(x, y)
            return getattr(paddle._C_ops, name)(*((y, x) if dunder in REFLECTED else (x, y)))
        return operator

    operators = {dunder: getattr(paddle.Tensor, dunder) for dunder in OPERATORS}
    try:
        for name, op in ops.items():
            setattr(paddle._C_ops, name, audited(name, op))
        for dunder, name in OPERATORS.items():
            setattr(paddle.Tensor, dunder, rerouted(dunder, name))
        yield mixed
    finally:
        for name, op in ops.items():
            setattr(paddle._C_ops, name, op)
        for dunder, op in operators.items():
            setattr(paddle.Tensor, dunder, op)
