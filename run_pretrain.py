"""Pretrain a model of any registered family (`modeling/registry.py`: LLaMA, Mistral, Qwen2/3, Gemma 1-3, Phi-3,
OLMo-2, SmolLM3, Granite, ERNIE 4.5, MPT, GPT-2 and the mixture-of-experts families):
`python run_pretrain.py [--config x.yaml] [flags]`, or under
`python -m paddle.distributed.launch --nproc_per_node N run_pretrain.py ...` for N ranks."""

from __future__ import annotations

import sys

from paddle_pp.runtime.lifetime import die_with_launcher

if __name__ == "__main__":
    die_with_launcher()  # first, before the heavy imports: a killed launcher takes its ranks along
    from paddle_pp.training.cli import main

    sys.exit(main())
