"""Loads one single-card model state into any layout, evaluates, trains a few steps, gathers back.

The test writes the single-card weights (`--init`, .npz) and an HF-style config with "model_type"
(`--config`, JSON); rank 0 writes the gathered single-card parameters after training to `--out`.
`--optimizer sgd` makes global-norm clipping visible in the update (AdamW is nearly invariant to it).
`--attention blockwise --block N` runs the blockwise attention core with N positions per block (under
`--context_parallel_degree`, the ring's kernel; each cp rank reads its two chunks of every sequence).
`--documents ID` trains with per-document attention, ID ending each document; the batches then hold it
in about one position in six; with `--across_documents` only the positions restart there (attention
spans the sample: `--reset_position_ids`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys

import numpy as np
import paddle

from checkpoint.single_card_state import gather_single_card_state, load_single_card_state
from modeling.attention_core import CORES, BlockwiseCore
from modeling.context_parallel import split_sequence
from modeling.execution import GRANULARITIES, Execution, Recompute
from modeling.registry import build_causal_lm, config_from_dict, plan_of
from paddle_pp.runtime.fleet_wrappers import wrap_model, wrap_optimizer
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.layout import Layout, add_layout_args
from paddle_pp.runtime.topology import end_job, init_distributed
from paddle_pp.training import gradient_path
from paddle_pp.training.step import eval_loss, replica_slice, train_step


def global_batch(step: int, batch: int, seq: int, vocab: int,
                 end_of_document: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2000 + step)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1))
    if end_of_document is not None:
        tokens[rng.random(tokens.shape) < 1 / 6] = end_of_document
    return tokens[:, :-1].astype("int64"), tokens[:, 1:].astype("int64")


def main(argv: list[str]) -> None:
    # Python's stack dump instead of Paddle's C++ handler: a rare silent SIGABRT seen in CI must
    # leave a trace of where every thread was.
    paddle.disable_signal_handler()
    faulthandler.enable(all_threads=True)
    parser = add_layout_args(argparse.ArgumentParser())
    parser.add_argument("--config", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--accumulate_steps", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--clip_norm", type=float, default=1.0)
    parser.add_argument("--attention", choices=sorted(CORES), default="dense")
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--across_documents", action="store_true")
    parser.add_argument("--recompute", choices=GRANULARITIES, default=None)
    args = parser.parse_args(argv)

    layout = Layout.from_args(args)
    micro = args.global_batch // layout.data_replicas // args.accumulate_steps
    topo = init_distributed(layout, micro_batch_size=micro, accumulate_steps=args.accumulate_steps)
    config = config_from_dict(json.loads(open(args.config).read()))
    core = BlockwiseCore(args.block) if args.attention == "blockwise" else CORES[args.attention]
    documents = None if args.documents is None else (args.documents,)
    raw = build_causal_lm(config, topo, Execution(attention=core, documents=documents,
                                                  within_documents=not args.across_documents,
                                                  recompute=Recompute(args.recompute)))
    axes = plan_of(config).tp_axes(layout.tp)
    load_single_card_state(raw, dict(np.load(args.init)), axes, topo)
    criterion = getattr(raw, "criterion", None)
    clip = paddle.nn.ClipGradByGlobalNorm(args.clip_norm)
    if args.optimizer == "sgd":
        optimizer = paddle.optimizer.SGD(learning_rate=0.5, parameters=raw.parameters(), grad_clip=clip)
    else:
        # epsilon 1e-6, not 1e-8: a gradient that is pure rounding noise (an exactly zero true gradient,
        # ~1e-10) would otherwise be normalised into a step of ~lr/100 whose value is that noise's,
        # and no two layouts (summation orders) agree on it
        optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, epsilon=1e-6, parameters=raw.parameters(),
                                           grad_clip=clip)
    model, optimizer = wrap_model(raw, topo), wrap_optimizer(optimizer)
    gradient_path.after_wrapping(optimizer, raw, topo, None)  # as the trainer: SP's norm gradients
    rows = replica_slice(args.global_batch, topo)

    def batch(step):
        x, y = global_batch(step, args.global_batch, args.seq, config.vocab_size, args.documents)
        x, y = x[rows], y[rows]
        if topo.ring is not None:  # context parallelism: this rank's two chunks of every sequence
            x, y = (split_sequence(t, topo.ring.degree, topo.ring.rank) for t in (x, y))
        return paddle.to_tensor(x), paddle.to_tensor(y)

    evaluation = eval_loss(model, criterion, *batch(0), topo)
    losses = [train_step(model, optimizer, criterion, *batch(step), topo, args.accumulate_steps)
              for step in range(args.steps)]
    state = gather_single_card_state(raw, axes, topo)
    if topo.global_rank == 0 and args.out:
        np.savez(args.out, **state)
    write_result({"eval_loss": evaluation, "losses": losses, "rank": topo.global_rank,
                  "param_names": sorted(state)})
    end_job(topo)


if __name__ == "__main__":
    main(sys.argv[1:])
