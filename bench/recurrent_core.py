"""The recurrent core (`modeling/recurrent_core.py`) against its token-by-token definition and against
the blockwise softmax attention core, forward and backward of one layer's mixer at 4k, 16k and 64k
tokens on one process: time and Paddle's peak host allocation (each run in its own process, best of
--repeats; attention to 16k and the token loop at 4k by default, as they take minutes beyond).
Gated DeltaNet's shape per rank of a Qwen3.5-9B-like layer under tp4 (8 value heads over 4 key heads,
d_k = d_v = 128); attention with 8 heads of 128. The recurrent core should grow linearly in
length (the chunked form: T / C chunks of fixed work), attention quadratically. The chunked form runs
as training runs it (`chunked`: spans of 16 chunks, each run again in the backward) and with autograd
keeping every chunk's products for the backward (`kept`: the form before the spans), side by side, to
show what the recompute saves in memory and costs in time.
Writes bench/results/recurrent_core.json.

  .venv/bin/python bench/recurrent_core.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from machine import machine, write_report  # noqa: E402

HEADS, KEY_HEADS, HEAD_DIM, CHUNK = 8, 4, 128, 64
RUN = """
import json, sys, time
import paddle
from modeling.attention_core import CORES
from modeling.recurrent_core import _chunked_span, chunked, recurrent_reference
from paddle_pp.training.activations import host_allocated
from paddle.base import core
form, seq = sys.argv[1], int(sys.argv[2])
heads, key_heads, dim, chunk = {heads}, {key_heads}, {dim}, {chunk}
paddle.seed(0)
if form == "attention":
    inputs = [paddle.randn([1, seq, heads, dim]) for _ in range(3)]
    run = lambda q, k, v: CORES["blockwise"](q, k, v, False)
else:
    q, k = (paddle.nn.functional.normalize(paddle.randn([1, seq, key_heads, dim]), axis=-1) for _ in range(2))
    inputs = [q * dim ** -0.5, k, paddle.randn([1, seq, heads, dim]), -paddle.rand([1, seq, heads]),
              paddle.nn.functional.sigmoid(paddle.randn([1, seq, heads]))]
    if form == "token":
        run = lambda *x: recurrent_reference(*x)[0]
    elif form == "kept":
        run = lambda *x: _chunked_span(*x, None, None, chunk)[0]
    else:
        run = lambda *x: chunked(*x, chunk_size=chunk)[0]
for tensor in inputs:
    tensor.stop_gradient = False
times = []
for repeat in range({repeats}):
    start = host_allocated()
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    began = time.perf_counter()
    out = run(*inputs)
    (out * out).sum().backward()
    times.append(time.perf_counter() - began)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - start
    del out
print(json.dumps({{"seconds": min(times), "peak_bytes": peak}}))
"""


def measure(form: str, seq: int, repeats: int) -> dict:
    code = RUN.format(heads=HEADS, key_heads=KEY_HEADS, dim=HEAD_DIM, chunk=CHUNK, repeats=repeats)
    done = subprocess.run([sys.executable, "-c", code, form, str(seq)], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO)}, timeout=7200)
    if done.returncode:
        return {"failed": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--token_lengths", type=int, nargs="+", default=[4096],
                        help="lengths the token-by-token definition runs at (a Python loop per token)")
    parser.add_argument("--attention_lengths", type=int, nargs="+", default=[4096, 16384],
                        help="lengths attention runs at (64k: about 13 TFLOP, minutes on 2 cores)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/recurrent_core.json")
    args = parser.parse_args(argv)
    rows = []
    for seq in args.lengths:
        forms = ("chunked", "kept") + (("attention",) if seq in args.attention_lengths else ()) + (
            ("token",) if seq in args.token_lengths else ())
        for form in forms:
            result = {"form": form, "tokens": seq, **measure(form, seq, args.repeats)}
            rows.append(result)
            shown = result.get("failed") or (f"{result['seconds']:.2f} s, peak {result['peak_bytes'] / 2**20:.0f} MiB")
            print(f"{form:>9} {seq:>6}: {shown}", flush=True)
    write_report(args.output, {"machine": machine(), "measured": time.strftime("%Y-%m-%d"),
                               "shape": {"heads": HEADS, "key_heads": KEY_HEADS, "head_dim": HEAD_DIM,
                                         "chunk": CHUNK}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
