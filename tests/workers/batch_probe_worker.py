"""Train as run_pretrain.py does and report, per step, the exact token rows this rank fed the model
(inputs and labels) with its coordinates, so a test can reassemble every global batch.

argv: run_pretrain.py flags
"""

from __future__ import annotations

import sys

from paddle_pp.runtime.launch import write_result
from paddle_pp.runtime.topology import end_job
from paddle_pp.training.arguments import parse_args
from paddle_pp.training.trainer import Pretrainer


def main() -> int:
    trainer = Pretrainer(parse_args(sys.argv[1:]))
    fed, original = [], trainer.batch_tensors

    def recording(dataset, indices):
        inputs, labels = original(dataset, indices)
        if dataset is trainer.train_data and inputs is not None:
            fed.append({"step": trainer.step + 1, "inputs": inputs.numpy().tolist(), "labels": labels.numpy().tolist()})
        return inputs, labels

    trainer.batch_tensors = recording
    trainer.train()
    topo = trainer.topo
    write_result({"rank": topo.global_rank, "replica": topo.data_replica_index, "replicas": topo.data_replica_count,
                  "tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank, "first_stage": topo.is_first_stage,
                  "last_stage": topo.is_last_stage, "fed": fed})
    return end_job(topo)


if __name__ == "__main__":
    sys.exit(main())
