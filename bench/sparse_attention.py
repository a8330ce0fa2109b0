"""DeepSeek Sparse Attention's core against the blockwise full core, measured side by side on this CPU:
forward + backward of one layer's attention, one process per (core, length, k) so peaks do not mix,
time and peak allocator bytes (Paddle's CPU statistic, above the inputs).

Both compute latent attention in its absorbed (MQA) form on the same tensors: q [1, seq, 4 heads, 160]
(a 128-wide latent and 32 rotary channels), one key per token [1, seq, 160] whose first 128 channels are
its value. The blockwise core attends to every earlier key (kv heads 1); the sparse core to each query's
k selected keys (random earlier positions: the cost does not depend on which). The sparse core's time
and memory should grow linearly in seq at fixed k, the full core's time quadratically.
Writes bench/results/sparse_attention.json.

  .venv/bin/python bench/sparse_attention.py [--lengths 8192 32768 65536] [--full_up_to 32768]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

HEADS, LATENT, ROPE = 4, 128, 32
RUN = """
import json, sys, time
import numpy as np
import paddle
from paddle.base import core
from modeling.attention_core.blockwise import blockwise_causal_attention
from modeling.attention_core.sparse import selected_attention
from paddle_pp.training.activations import host_allocated
name, seq, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
heads, latent, dim = {heads}, {latent}, {latent} + {rope}
q = paddle.randn([1, seq, heads, dim]) * 0.1
keys = paddle.randn([1, seq, dim]) * 0.1
for t in (q, keys):
    t.stop_gradient = False
upstream = paddle.randn([1, seq, heads, latent])
if name == "sparse":
    rng = np.random.default_rng(0)
    positions = np.arange(seq)[None, :, None]
    indices = paddle.to_tensor(np.floor(rng.random((1, seq, k), np.float32) * (positions + 1)).astype(np.int64))
    visible = paddle.to_tensor(np.broadcast_to(np.arange(k)[None, None, :] <= positions, (1, seq, k)).copy())
    attend = lambda: selected_attention(q, keys, indices, visible, latent, dim ** -0.5)[0]
else:
    attend = lambda: blockwise_causal_attention(q, keys.unsqueeze(2), keys[..., :latent].unsqueeze(2)).reshape(
        [1, seq, heads, latent])
times = []
for repeat in range(2):
    start = host_allocated()
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    began = time.perf_counter()
    (attend() * upstream).sum().backward()
    times.append(time.perf_counter() - began)
    peak = int(core.host_memory_stat_peak_value("Allocated", 0)) - start
print(json.dumps({{"seconds": min(times), "peak_bytes": peak}}))
""".format(heads=HEADS, latent=LATENT, rope=ROPE)


def measure(name: str, seq: int, k: int) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, name, str(seq), str(k)], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}, timeout=7200)
    if done.returncode:
        return {"failed": f"exit status {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--topk", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--full_up_to", type=int, default=32768, help="the full core's longest length (its time "
                                                                       "grows as seq^2)")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    cases = [(f"sparse k={k}", "sparse", k) for k in args.topk] + [("blockwise full", "blockwise", 0)]
    for label, name, k in cases:
        results[label] = {}
        for seq in args.lengths:
            if name == "blockwise" and seq > args.full_up_to:
                results[label][seq] = {"skipped": f"over --full_up_to {args.full_up_to}"}
                continue
            results[label][seq] = measure(name, seq, k)
            got = results[label][seq]
            print(f"{label:>15} {seq:>6}: " + (f"{got['seconds']:.2f} s, peak {got['peak_bytes'] / 2**20:.0f} MiB"
                                                if "seconds" in got else str(got)), flush=True)
    write_report(REPO / "bench" / "results" / "sparse_attention.json",
                 {"machine": machine(), "shape": {"heads": HEADS, "latent": LATENT, "rope": ROPE}, "results": results})


if __name__ == "__main__":
    main()
