"""Model folders as users bring them, each started under one layout in one launch: for every folder,
the model its config.json describes is built for this rank (`build_causal_lm`), its weights read as
`--model_name_or_path` reads them (each rank its tp pieces and its experts), evaluated on a batch (the
loss transformers computed on the same rows is the test's), trained two steps (the experts'
correction biases moved after each by the balancing rule, as the trainer does) and saved as a
unified checkpoint (single-card tensors; with --save_to_hf in transformers' layout, which the test
loads in transformers as it is; compared with other layouts'). One launch serves every family: the
process group, fleet's hybrid topology and Paddle's start-up are paid once.

BLOCK is the blockwise attention core's block and the recurrent core's chunk (two chunks per span).
argv: ROWS.npy OUT_DIR BLOCK FOLDER... [layout flags] [--recompute] [--save_to_hf] [--micro_batch_size N].
Result: per folder its loss on the rows, the two training losses and each MoE layer's correction bias this rank holds after the
first step; checkpoints under OUT_DIR/<folder name>/checkpoint-2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import paddle

from checkpoint.save import save_checkpoint
from modeling.attention_core import BlockwiseCore
from modeling.execution import Execution, Recompute
from modeling.recurrent_core import RecurrentCore
from modeling.registry import build_causal_lm, config_from_dict, plan_of, validate_layout
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.interop.transformers_layout import TransformersWeights
from paddle_pp.runtime.fleet_wrappers import wrap_for_layout
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.layout import Layout, add_layout_args
from paddle_pp.runtime.topology import end_job, init_distributed
from paddle_pp.training import gradient_path
from paddle_pp.training.expert_balance import balanced_layers, update_correction_biases
from paddle_pp.training.grad_norm import ReportingGlobalNormClip
from paddle_pp.training.router_metrics import step_routing
from paddle_pp.training.step import eval_loss, replica_slice, train_step

ACCUMULATE = 2  # micro-batches per step unless --micro_batch_size says: at pp2, 1F1B still has two in flight
BIAS_RATE = 1e-3  # the trainer's default --moe_router_bias_update_rate


def start(folder: Path, rows: np.ndarray, out: Path, choices: Execution, topo, save_to_hf: bool) -> dict:
    accumulate = choices.accumulate_steps
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    validate_layout(config, topo.layout)
    raw = build_causal_lm(config, topo, choices)
    plan = plan_of(config)
    load_pretrained(pretrained, raw, plan.tp_axes(topo.layout.tp), topo)
    clip = ReportingGlobalNormClip(1.0)  # the trainer's: every expert's gradient counted once under ep
    # epsilon 1e-6: at 1e-8 Adam's first steps move an entry whose gradient is only summation noise (an
    # expert few tokens reached) by up to lr, and layouts sum in different orders
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=raw.parameters(), grad_clip=clip, epsilon=1e-6)
    gradient_path.before_wrapping(raw, topo)
    model, optimizer = wrap_for_layout(raw, optimizer, topo)
    gradient_path.after_wrapping(optimizer, raw, topo, clip)
    criterion, mine = getattr(raw, "criterion", None), replica_slice(len(rows), topo)
    inputs, labels = (paddle.to_tensor(rows[mine, :-1]), paddle.to_tensor(rows[mine, 1:]))
    stats = raw.run.router_stats
    result = {"loss": eval_loss(model, criterion, inputs, labels, topo), "losses": []}
    def balance() -> None:  # as the trainer: the step's loads over the job (an MoE model's), then the rule
        routing = step_routing(stats, config, topo)
        if routing is not None:
            update_correction_biases(raw, routing.loads, BIAS_RATE)

    for step in range(2):
        result["losses"].append(train_step(model, optimizer, criterion, inputs, labels, topo, accumulate,
                                           after_update=balance))
        if step == 0:
            result["biases"] = {str(layer.layer_index): layer.router_layer.correction.numpy().tolist()
                                for layer in balanced_layers(raw)}
    save_checkpoint(out / folder.name, 2, raw, optimizer, topo, plan, config=config, trainer_state={"step": 2},
                    rewrite=TransformersWeights(config) if save_to_hf else None)
    return result


def main(argv: list[str]) -> None:
    parser = add_layout_args(argparse.ArgumentParser())
    parser.add_argument("rows")
    parser.add_argument("out")
    parser.add_argument("block", type=int)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--recompute", action="store_true", help="recompute whole decoder layers")
    parser.add_argument("--save_to_hf", action="store_true", help="checkpoints in transformers' layout")
    parser.add_argument("--micro_batch_size", type=int, help="the same on every layout compared: an MoE layer's "
                        "Switch aux loss is a micro-batch's statistic")
    args = parser.parse_args(argv)
    rows = np.load(args.rows).astype("int64")
    layout = Layout.from_args(args)
    micro_batch = args.micro_batch_size or len(rows) // layout.data_replicas // ACCUMULATE
    accumulate = len(rows) // layout.data_replicas // micro_batch
    topo = init_distributed(layout, micro_batch_size=micro_batch, accumulate_steps=accumulate)
    choices = Execution(attention=BlockwiseCore(args.block), recurrent=RecurrentCore(args.block, span_chunks=2),
                        recompute=Recompute("full" if args.recompute else None), accumulate_steps=accumulate)
    results = {Path(folder).name: start(Path(folder), rows, Path(args.out), choices, topo, args.save_to_hf) for folder in args.folders}
    write_result({"rank": topo.global_rank, "folders": results})
    end_job(topo)


if __name__ == "__main__":
    main(sys.argv[1:])
