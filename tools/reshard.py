"""Offline layout tools for checkpoints (one process, no launcher; every rewrite streams tensors).

  plan    (--checkpoint DIR | --config config.json) + layout flags: is the layout valid, what does
          each rank hold and read to resume, what does it write in a save, and how long would the
          save take (from --disk_gbps, --link_gbps, --fs_gbps)? A config alone simulates any size.
  split   SOURCE TARGET + layout flags: a per-rank pre-split copy the trainer loads under that layout
  join    SOURCE TARGET: a pre-split copy back to the unified format
  merge   SOURCE TARGET: Paddle fleet per-rank files (model_state.tpXX_ppYY.pdparams,
          optimizer.tpXX_ppYY[_shardZZ].pdopt, config.json, trainer_state.json) to the unified format
  paddleformers SOURCE TARGET [--model FOLDER]: a PaddleFormers checkpoint to the unified format, in
          either of its formats: flex (model_state/, optimizer_state/, master_weight/, trainer_state.bin;
          FOLDER, the one the run started from, gives the config and tokenizer it lacks) or unified
          (model-*.safetensors in transformers' layout, optimizer-*.safetensors, config.json)
  to-flex SOURCE TARGET: a unified checkpoint (either weights layout) written back in PaddleFormers' flex
          format, for its trainer to resume
  rechunk SOURCE TARGET --max_shard_mb N: rewrite a unified checkpoint with another shard size
  weights SOURCE TARGET [--dtype bfloat16]: a weights-only copy (no optimizer, no trainer state) to hand on;
          with --fuse_attention_qkv / --fuse_attention_ffn in PaddleNLP's fused-projection layout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from checkpoint.format import CheckpointError
from checkpoint.save_plan import estimate_save, save_items
from checkpoint.shards import EXPORT_DTYPES
from checkpoint.split import join_split, split_checkpoint
from checkpoint.unified_io import export_weights, rechunk
from checkpoint.writers import assign_writers
from modeling.paddlenlp_fused import FFN, QKV
from modeling.registry import config_from_dict, plan_of, validate_layout
from paddle_pp.interop.fleet import merge_fleet
from paddle_pp.interop.paddleformers import export_flex, import_paddleformers
from paddle_pp.interop.pickled import ALLOW_UNSAFE_PICKLE_HELP
from paddle_pp.interop.pretrained import our_config_of
from paddle_pp.interop.transformers import export_paddlenlp_fused
from paddle_pp.interop.transformers_layout import checkpoint_config
from paddle_pp.planning.memory import dispatch_bytes_per_step, plan_layout, ring_bytes_per_step
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout, add_layout_args
from paddle_pp.training.arguments import add_trainer_flags, arguments_of
from paddle_pp.training.model_config import end_of_document
from paddle_pp.training.report import tensor_progress
from paddle_pp.training.run_plan import plan_run

DATA_SUFFIXES = {".safetensors", ".pdparams", ".pdopt", ".distcp"}


def _plan(args, given: frozenset[str]) -> int:
    folder = args.checkpoint if args.checkpoint else args.config.parent
    config = config_from_dict(checkpoint_config(args.checkpoint) if args.checkpoint else
                              our_config_of(json.loads(args.config.read_text()), args.config))
    trainer_args = arguments_of(args, given)
    run = plan_run(trainer_args, config, end_of_document(trainer_args, folder), args.world_size, args.device)
    layout, compute_bytes, workload = run.layout, run.compute_bytes, run.workload()
    shares = plan_layout(config, layout, compute_bytes=compute_bytes, workload=workload)
    print(f"layout {layout.describe()} on {layout.world_size} ranks: valid")
    for note in run.notes:
        print(f"note: {note}")
    print(f"{'stage':>5} {'tp':>3} {'params':>12} {'weights MB':>11} {'grads MB':>9} {'optim MB':>9} "
          f"{'activations MB':>14} {'total MB':>9} {'load reads MB':>13}")
    for s in shares:
        print(f"{s.stage:>5} {s.tp_rank:>3} {s.parameters:>12,} {s.weight_bytes / 2**20:>11.1f} "
              f"{s.grad_bytes / 2**20:>9.1f} {s.optimizer_bytes / 2**20:>9.1f} {s.activation_bytes / 2**20:>14.1f} "
              f"{s.total_bytes / 2**20:>9.1f} {s.load_bytes / 2**20:>13.1f}")
    granularity = run.execution.recompute.granularity
    print(f"(every dp/sharding/cp rank at a (stage, tp) holds and reads the same; activations: the decoder layers' at "
          f"the step's peak for micro-batch {workload.micro_batch} x {workload.seq_len} tokens"
          f"{f', recompute {granularity}' if granularity else ''}, {run.execution.attention.name} attention core; "
          "embedding, head and loss not included)")
    if layout.cp > 1:
        print(f"context parallel ring: each rank sends {ring_bytes_per_step(config, layout, workload, compute_bytes) / 2**20:.1f} "
              f"MB per step ({layout.cp} ranks per sequence, {workload.seq_len // layout.cp} tokens each)")
    if layout.ep > 1:
        balanced, worst = dispatch_bytes_per_step(config, layout, workload, compute_bytes)
        print(f"expert dispatch: each rank sends {balanced / 2**20:.1f} MB per step with balanced routing, at most "
              f"{worst / 2**20:.1f} MB ({layout.ep} ranks per expert group, {config.num_experts // layout.ep} experts "
              "each)")
    slots = layout.rank_slots()
    writes = assign_writers(save_items(plan_of(config), layout, compute_bytes), layout.tp)
    if len(slots) <= args.max_rows:
        print(f"\nsave: {'rank':>4} {'stage':>5} {'replica':>7} {'tp':>3} {'writes MB':>10} "
              f"{'stage3 gather in MB':>19}")
        for rank, slot in enumerate(slots):
            print(f"      {rank:>4} {slot[0]:>5} {slot[1]:>7} {slot[2]:>3} "
                  f"{writes.written.get(slot, 0) / 2**20:>10.1f} {writes.received.get(slot, 0) / 2**20:>19.1f}")
    estimate = estimate_save(writes, slots, args.disk_gbps, args.link_gbps, args.fs_gbps)
    print(f"save of {sum(writes.written.values()) / 1e9:.2f} GB over {len(slots)} ranks: writes per rank max "
          f"{estimate.max_write_bytes / 1e9:.2f} GB, mean {estimate.mean_write_bytes / 1e9:.2f} GB (max/mean "
          f"{estimate.balance:.3f}); TP pieces are written in place; stage3 gathers bring a rank up to "
          f"{estimate.max_received_bytes / 1e9:.2f} GB")
    fs = f", file system {args.fs_gbps} GB/s in all" if args.fs_gbps else ""
    print(f"predicted save time {estimate.seconds:.1f} s (per rank: disk {args.disk_gbps} GB/s, "
          f"interconnect {args.link_gbps} GB/s{fs})")
    return 0


def _rewrite(args) -> int:
    """split, join, merge, rechunk and weights: a streaming rewrite of SOURCE into TARGET with a progress bar."""
    if not args.source.is_dir():
        raise CheckpointError(f"{args.source} is not a folder")
    total = sum(p.stat().st_size for p in args.source.rglob("*") if p.suffix in DATA_SUFFIXES)
    with tensor_progress(total, args.command) as on_tensor:
        if args.command == "split":
            layout = Layout.from_args(args, world_size=args.tensor_parallel_degree * args.pipeline_parallel_degree
                                      * args.sharding_parallel_degree, device="cpu")
            config = config_from_dict(checkpoint_config(args.source))
            validate_layout(config, layout)
            out = split_checkpoint(args.source, args.target, layout, plan_of(config), on_tensor)
        elif args.command == "weights" and (args.fuse_attention_qkv or args.fuse_attention_ffn):
            fused = frozenset(name for name in (QKV, FFN) if getattr(args, name))
            out = export_paddlenlp_fused(args.source, args.target, fused, int(args.max_shard_mb * 2**20), on_tensor,
                                         args.dtype)
        elif args.command == "weights":
            out = export_weights(args.source, args.target, args.dtype, int(args.max_shard_mb * 2**20), on_tensor)
        elif args.command == "merge":
            out = merge_fleet(args.source, args.target, int(args.max_shard_mb * 2**20), on_tensor,
                              args.allow_unsafe_pickle)
        elif args.command == "paddleformers":
            out = import_paddleformers(args.source, args.target, args.model, int(args.max_shard_mb * 2**20), on_tensor)
        elif args.command == "to-flex":
            out = export_flex(args.source, args.target, on_tensor)
        else:
            rewrite = {"join": join_split, "rechunk": rechunk}[args.command]
            out = rewrite(args.source, args.target, int(args.max_shard_mb * 2**20), on_tensor)
    print(f"wrote {out}")
    return 0


SUBCOMMANDS = {"split": "write a per-rank pre-split copy for a layout", "join": "a pre-split copy back to unified",
               "merge": "fleet per-rank .pdparams/.pdopt files to unified",
               "paddleformers": "a PaddleFormers checkpoint (flex or unified) to unified",
               "to-flex": "a unified checkpoint to PaddleFormers' flex format",
               "rechunk": "change the shard size",
               "weights": "a weights-only copy to hand a model on (optionally bfloat16/float16)"}


def build_parser() -> argparse.ArgumentParser:
    """`plan` and the rewrites of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = add_trainer_flags(commands.add_parser("plan", help="validate a run (layout, model and the trainer's "
                                                               "flags) and size each rank"))
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path)
    source.add_argument("--config", type=Path, help="a config.json with model_type")
    plan.add_argument("--world_size", type=int, required=True)
    plan.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    plan.add_argument("--disk_gbps", type=float, default=2.0, help="write bandwidth of one rank, GB/s")
    plan.add_argument("--link_gbps", type=float, default=25.0, help="receive bandwidth of a rank (stage3), GB/s")
    plan.add_argument("--fs_gbps", type=float, default=None, help="aggregate write bandwidth of a shared file system")
    plan.add_argument("--max_rows", type=int, default=64, help="print the per-rank save table up to this many ranks")
    for name, text in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=text)
        sub.add_argument("source", type=Path)
        sub.add_argument("target", type=Path, help="a new folder (written as TARGET.partial, renamed when complete)")
        if name == "split":
            add_layout_args(sub)
        elif name != "to-flex":
            sub.add_argument("--max_shard_mb", type=float, required=name == "rechunk", default=5 * 1024,
                             help="largest output shard")
        if name == "weights":
            sub.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32")
            for flag in (QKV, FFN):
                sub.add_argument(f"--{flag}", action="store_true",
                                 help=f"store the projections fused as PaddleNLP's model with {flag} does")
        if name == "merge":
            sub.add_argument("--allow_unsafe_pickle", action="store_true", help=ALLOW_UNSAFE_PICKLE_HELP)
        if name == "paddleformers":
            sub.add_argument("--model", type=Path, help="for a flex checkpoint: the folder the run started from, "
                                                        "its config.json and tokenizer (a flex checkpoint has neither)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _plan(args, _given(parser, argv)) if args.command == "plan" else _rewrite(args)
    except (UserError, ValueError) as err:
        print(f"reshard.py: error: {err}", file=sys.stderr)
        return 1


def _given(parser: argparse.ArgumentParser, argv: list[str] | None) -> frozenset[str]:
    """The flags the command line sets, whatever their value (the trainer's rules read which were
    given, not defaulted); the parser is spent after this."""
    for action in parser._subparsers._group_actions[0].choices["plan"]._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
