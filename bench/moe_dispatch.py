"""An MoE layer's experts on one rank, run the old way and the new way side by side in one process.

Before: for every expert, a `nonzero` over the routing (a host synchronisation each: 64 per layer),
a gather, the expert, an `index_add`. After (`SparseMoE._local`): the (token, choice) rows sorted by
expert once, their counts read once (one host synchronisation per layer), each expert on its slice,
one `index_add`. Same routing, same result (checked); tokens per second of forward + backward of the
layer for DeepSeek-V2-Lite's expert shape scaled down (64 experts, top-6, hidden 512, expert width 256),
fp32, several token counts. Writes bench/results/moe_dispatch.json.

  .venv/bin/python bench/moe_dispatch.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import paddle

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from machine import machine, write_report  # noqa: E402

from modeling.blocks.mlp import GatedMLP  # noqa: E402
from modeling.blocks.moe import Experts, MoE  # noqa: E402
from modeling.blocks.router import Routing  # noqa: E402
from modeling.execution import Execution  # noqa: E402

EXPERTS, TOP_K, HIDDEN, WIDTH = 64, 6, 512, 256


def per_expert_loop(layer, flat, chosen, weights):
    """The loop this replaced: one nonzero (host synchronisation) per expert."""
    out = paddle.zeros_like(flat)
    for e, expert in enumerate(layer.experts.children()):
        hit = chosen == e
        token = paddle.nonzero(hit)[:, 0]
        if token.shape[0]:
            routed, weight = paddle.gather(flat, token), paddle.masked_select(weights, hit).unsqueeze(-1)
        else:
            token = paddle.zeros([1], "int64")
            routed, weight = paddle.zeros([1, flat.shape[1]], flat.dtype), paddle.zeros([1, 1], flat.dtype)
        out = paddle.index_add(out, token, 0, expert(routed) * weight)
    return out


def timed_pair(first, second, repeats: int = 5) -> tuple[float, float]:
    """Best seconds of each of two runs, alternated so that a slow spell of the machine hits both."""
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for slot, run in enumerate((first, second)):
            began = time.perf_counter()
            run()
            best[slot] = min(best[slot], time.perf_counter() - began)
    return best[0], best[1]


def main() -> None:
    paddle.seed(0)
    declared = MoE(0, HIDDEN, Experts(EXPERTS, GatedMLP(HIDDEN, WIDTH)), Routing(TOP_K, renormalize=True))
    layer = declared.build(None, Execution())
    rows = {}
    for tokens in (512, 2048, 8192):
        flat = paddle.randn([tokens, HIDDEN])
        flat.stop_gradient = False
        _, chosen, weights = layer.route(flat)
        weights = weights.detach()  # a leaf: each timed pass runs its own backward through the experts only
        weights.stop_gradient = False

        def step(dispatch):
            out = dispatch(flat, chosen, weights)
            out.sum().backward()
            return out

        new = layer._local(flat, chosen, weights)[0]
        np.testing.assert_allclose(new.numpy(), per_expert_loop(layer, flat, chosen, weights).numpy(), rtol=1e-5,
                                   atol=1e-6)
        before, after = timed_pair(lambda: step(lambda *a: per_expert_loop(layer, *a)),
                                   lambda: step(lambda *a: layer._local(*a)[0]))
        rows[tokens] = {"before_tokens_per_sec": tokens / before, "after_tokens_per_sec": tokens / after,
                        "speedup": before / after}
        print(tokens, rows[tokens], flush=True)
    out = {**machine(), "measured": time.strftime("%Y-%m-%d"), "experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN,
           "expert_width": WIDTH, "rows": rows}
    write_report(REPO / "bench" / "results" / "moe_dispatch.json", out)


if __name__ == "__main__":
    main()
