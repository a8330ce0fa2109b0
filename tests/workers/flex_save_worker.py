"""Saves a flex checkpoint with Paddle's own `paddle.distributed.save_state_dict` from 2 ranks, in the
pieces PaddleFormers' layouts write: rows split as tensor parallelism splits them, uneven columns,
a flat range each (sharding stage1 v2's optimizer states), a replicated vector stored once, and a
bfloat16 matrix; rank 0 writes the whole arrays beside it (expected.npz).

argv: <output folder>
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.layout import Layout
from paddle_pp.runtime.topology import align_ranks, end_job, init_distributed


def whole_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"model.layers.0.mlp.up_proj.weight": rng.standard_normal((6, 4)).astype(np.float32),
            "model.embed_tokens.weight": rng.standard_normal((5, 3)).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight.moment1_0": rng.standard_normal((6, 4)).astype(np.float32),
            "model.norm.weight": rng.standard_normal((4,)).astype(np.float32),
            "lm_head.weight": rng.standard_normal((4, 8)).astype(np.float32)}


def main() -> int:
    folder = Path(sys.argv[1])
    topo = init_distributed(Layout(world_size=2), 1, 1)
    rank, whole = topo.global_rank, whole_arrays()
    rows, cols = (slice(0, 3), slice(3, 6))[rank], ([0, 1], [2])[rank]
    flat = (slice(0, 7), slice(7, 24))[rank]
    up, embed, moment = (whole[key] for key in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
                                                 "model.layers.0.mlp.up_proj.weight.moment1_0"))
    head = paddle.to_tensor(whole["lm_head.weight"]).astype("bfloat16")
    pieces = {
        "model.layers.0.mlp.up_proj.weight": ShardedWeight(
            "model.layers.0.mlp.up_proj.weight", paddle.to_tensor(up[rows]), (3, 4), (6, 4), (3 * rank, 0)),
        "model.embed_tokens.weight": ShardedWeight(
            "model.embed_tokens.weight", paddle.to_tensor(embed[:, cols]), (5, len(cols)), (5, 3), (0, cols[0])),
        "model.layers.0.mlp.up_proj.weight.moment1_0": ShardedWeight(
            "model.layers.0.mlp.up_proj.weight.moment1_0", paddle.to_tensor(moment.reshape(-1)[flat]), (6, 4), (6, 4),
            (0, 0), is_flattened=True, flattened_range=flat),
        "model.norm.weight": ShardedWeight("model.norm.weight", paddle.to_tensor(whole["model.norm.weight"]), (4,), (4,),
                                           (0,)),
        "lm_head.weight": ShardedWeight("lm_head.weight", head[:, 4 * rank:4 * rank + 4], (4, 4), (4, 8),
                                        (0, 4 * rank)),
    }
    dist.save_state_dict(pieces, str(folder))
    if rank == 0:
        whole["lm_head.weight"] = head.astype("float32").numpy()  # what bfloat16 keeps of it
        np.savez(folder.parent / "expected.npz", **whole)
    align_ranks(topo)
    write_result({"rank": rank})
    end_job(topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
