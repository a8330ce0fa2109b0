"""What this CPU pays for fp32 subnormal numbers, per op family, and what the blockwise core fed its
products before the flush (paddle_pp/runtime/normal_range.py). Intel Xeons compute on subnormals
through microcode assists (a matmul with half its operand subnormal: 163 ms against 1.8); AMD EPYC
pays next to nothing; so a reader on another CPU runs this to know which kind theirs is.

1. Op families, each timed on normal and on subnormal inputs of the same shape (best of the
   repeats of three alternating half-second rounds each): the attention product (probabilities [1, 3, 1536, 512] by values
   [1, 3, 512, 64]), elementwise multiply, exp, a row sum, softmax, sigmoid (the router's), and one
   AdamW update of a [4096, 1024] parameter whose moments are subnormal (tiny gradients' second
   moments decay into that range).
2. The blockwise core, forward and backward at 1,024 tokens ([1, seq, 9 heads (3 kv), 64]): how
   many subnormal values reach its matmuls, and its time, with the flush and with it disabled.
3. Freed memory kept (paddle_pp/runtime/host_memory.py): `relu` and `exp` of fresh [1, 3, 1536, 512]
   and [4, 1024, 12000] tensors in a process with glibc's defaults and in one with our setting.
Writes bench/results/denormals.json.

  .venv/bin/python bench/denormals.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402
from machine import machine, write_report  # noqa: E402

import paddle_pp.runtime.normal_range as normal_range  # noqa: E402
from modeling.attention_core import CORES, blockwise  # noqa: E402

SUBNORMAL = 2.94e-39  # what Paddle's CPU exp returns for -inf
PROBS, VALUES = [1, 3, 1536, 512], [1, 3, 512, 64]
ROUNDS = 3


def best_seconds(fn, budget: float = 1.0) -> float:
    fn()
    times, began = [], time.perf_counter()
    while time.perf_counter() - began < budget or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _adam_step(moment: float):
    weight = paddle.create_parameter([4096, 1024], "float32")
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=[weight])
    weight.grad = paddle.full(weight.shape, 1e-20)  # its square is subnormal
    optimizer.step()
    for name, state in optimizer.state_dict().items():
        if "moment" in name:
            state.set_value(paddle.full(state.shape, moment))
    return optimizer.step


def op_families() -> dict:
    values = paddle.randn(VALUES)
    cases = {
        "attention product (matmul)": lambda x: paddle.matmul(x, values),
        "elementwise multiply": lambda x: x * x,
        "exp": paddle.exp,
        "row sum": lambda x: x.sum(-1),
        "softmax": lambda x: F.softmax(x, -1),
        "sigmoid": F.sigmoid,
    }
    normal, subnormal = paddle.rand(PROBS), paddle.full(PROBS, SUBNORMAL)
    pairs = {name: (lambda op=op: op(normal), lambda op=op: op(subnormal)) for name, op in cases.items()}
    pairs["AdamW update"] = (_adam_step(1e-3), _adam_step(SUBNORMAL))
    out = {}
    for name, (on_normal, on_subnormal) in pairs.items():
        times = [[], []]
        for _ in range(ROUNDS):  # alternated: a machine's drift falls on both
            times[0].append(best_seconds(on_normal, budget=0.5))
            times[1].append(best_seconds(on_subnormal, budget=0.5))
        out[name] = {"normal_ms": 1e3 * min(times[0]), "subnormal_ms": 1e3 * min(times[1])}
    for name, row in out.items():
        row["ratio"] = row["subnormal_ms"] / row["normal_ms"]
        print(f"{name:>28}: {row['normal_ms']:8.2f} ms normal, {row['subnormal_ms']:8.2f} ms subnormal "
              f"({row['ratio']:.2f}x)", flush=True)
    return out


def blockwise_core(seq: int = 1024) -> dict:
    q, k, v = (paddle.randn([1, seq, n, 64]) for n in (9, 3, 3))
    for t in (q, k, v):
        t.stop_gradient = False
    upstream = paddle.randn([1, seq, 9 * 64])
    matmul, flush = paddle.matmul, normal_range.flush_subnormals_  # blockwise calls it by both names
    counted = {"subnormal": 0, "operands": 0}

    def counting(x, y, *args, **kwargs):
        for t in (x, y):
            counted["subnormal"] += normal_range.subnormal_count(t)
            counted["operands"] += int(np.prod(t.shape))
        return matmul(x, y, *args, **kwargs)

    def step():
        (CORES["blockwise"](q, k, v, False) * upstream).sum().backward()

    out = {}
    for label, flushing in (("flushed", flush), ("not flushed", lambda t: t)):
        normal_range.flush_subnormals_ = blockwise.flush_subnormals_ = flushing
        seconds = best_seconds(step, budget=3.0)
        paddle.matmul = counting
        counted.update(subnormal=0, operands=0)
        step()
        paddle.matmul = matmul
        out[label] = {"seconds": seconds, **counted}
        print(f"blockwise {seq} tokens, {label}: {seconds:.3f} s, {counted['subnormal']:,} subnormal of "
              f"{counted['operands']:,} matmul operand values", flush=True)
    normal_range.flush_subnormals_ = blockwise.flush_subnormals_ = flush
    return out


FRESH_TENSORS = """
import json, sys, time
if sys.argv[1] == "freed memory kept":
    import paddle_pp  # its import keeps freed memory (runtime/host_memory.py)
import paddle
out = {}
for shape in ([1, 3, 1536, 512], [4, 1024, 12000]):
    x = paddle.randn(shape)
    for name, op in (("relu", paddle.nn.functional.relu), ("exp", paddle.exp)):
        op(x)
        began = time.perf_counter()
        for _ in range(10):
            op(x)
        out[f"{name} {shape}"] = (time.perf_counter() - began) / 10 * 1e3
print(json.dumps(out))
"""


def freed_memory() -> dict:
    """One process with glibc's defaults (Paddle alone), one as ours run (`paddle_pp` imported)."""
    out = {}
    for setting in ("glibc defaults", "freed memory kept"):
        done = subprocess.run([sys.executable, "-c", FRESH_TENSORS, setting], capture_output=True, text=True, check=True,
                              cwd=REPO, env={"PYTHONPATH": str(REPO)})
        out[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    for name in out["glibc defaults"]:
        before, after = out["glibc defaults"][name], out["freed memory kept"][name]
        print(f"{name:>28}: {before:8.2f} ms with glibc's defaults, {after:8.2f} ms kept ({before / after:.1f}x)",
              flush=True)
    return out


def main() -> None:
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "op_families": op_families(),
           "blockwise_1024": blockwise_core(), "fresh_tensors_ms": freed_memory()}
    write_report(REPO / "bench" / "results" / "denormals.json", out)


if __name__ == "__main__":
    main()
