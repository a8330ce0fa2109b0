"""Model folders as users bring them, each started under one layout in one launch: for every folder,
the model its config.json describes is built for this rank (`build_causal_lm`), its weights read as
`--model_name_or_path` reads them (each rank its tp pieces), evaluated on a batch (the loss
transformers computed on the same rows is the test's), trained two steps and saved as a unified
checkpoint (single-card names; the test exports it back to transformers). One launch serves every
family: the process group, fleet's hybrid topology and Paddle's start-up are paid once.

argv: ROWS.npy OUT_DIR BLOCK FOLDER... [layout flags]. Result: per folder its loss on the rows and the
two training losses; checkpoints under OUT_DIR/<folder name>/checkpoint-2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import paddle

from checkpoint.save import save_checkpoint
from modeling import tp_gradients
from modeling.attention_core import BlockwiseCore
from modeling.execution import Execution
from modeling.registry import build_causal_lm, config_from_dict, plan_of, validate_layout
from paddle_pp.interop.pretrained import load_pretrained, open_pretrained
from paddle_pp.runtime.fleet_wrappers import wrap_model, wrap_optimizer
from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.layout import Layout, add_layout_args
from paddle_pp.runtime.topology import end_job, init_distributed
from paddle_pp.training.step import eval_loss, replica_slice, train_step

ACCUMULATE = 4  # micro-batches per step: the pipeline's 1F1B has more than one in flight


def start(folder: Path, rows: np.ndarray, out: Path, block: int, topo) -> dict:
    pretrained = open_pretrained(folder)
    config = config_from_dict(pretrained.config)
    validate_layout(config, topo.layout)
    raw = build_causal_lm(config, topo, Execution(attention=BlockwiseCore(block)))
    plan = plan_of(config)
    load_pretrained(pretrained, raw, plan.axes(), topo)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=raw.parameters(),
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    model, optimizer = wrap_model(raw, topo), wrap_optimizer(optimizer)
    tp_gradients.sum_before_update(optimizer, raw, topo.tp_group)
    criterion, mine = getattr(raw, "criterion", None), replica_slice(len(rows), topo)
    inputs, labels = (paddle.to_tensor(rows[mine, :-1]), paddle.to_tensor(rows[mine, 1:]))
    result = {"loss": eval_loss(model, criterion, inputs, labels, topo),
              "losses": [train_step(model, optimizer, criterion, inputs, labels, topo, ACCUMULATE) for _ in range(2)]}
    save_checkpoint(out / folder.name, 2, raw, optimizer, topo, plan, config=config, trainer_state={"step": 2})
    return result


def main(argv: list[str]) -> None:
    parser = add_layout_args(argparse.ArgumentParser())
    parser.add_argument("rows")
    parser.add_argument("out")
    parser.add_argument("block", type=int)
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args(argv)
    rows = np.load(args.rows).astype("int64")
    layout = Layout.from_args(args)
    topo = init_distributed(layout, micro_batch_size=len(rows) // layout.data_replicas // ACCUMULATE,
                            accumulate_steps=ACCUMULATE)
    results = {Path(folder).name: start(Path(folder), rows, Path(args.out), args.block, topo)
               for folder in args.folders}
    write_result({"rank": topo.global_rank, "folders": results})
    end_job(topo)


if __name__ == "__main__":
    main(sys.argv[1:])
