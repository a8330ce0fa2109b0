"""Fine-tune a model of any registered family on chat data (`--train_dataset_path`, rendered by the model
folder's chat template; only the assistant's turns train, the loss taken per optimizer step):
`python run_finetune.py --model_name_or_path <folder> --train_dataset_path data.jsonl [flags]`, or under
`python -m paddle.distributed.launch --nproc_per_node N run_finetune.py ...`. The trainer and flags are
run_pretrain.py's (PaddleNLP's llm/run_finetune.py name)."""

from __future__ import annotations

import sys

from paddle_pp.runtime.lifetime import die_with_launcher

if __name__ == "__main__":
    die_with_launcher()  # first, before the heavy imports: a killed launcher takes its ranks along
    from paddle_pp.training.cli import main

    sys.exit(main(finetune=True))
