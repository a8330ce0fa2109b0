"""LoRA checkpoints (a run with --lora) out to other programs:

  peft CHECKPOINT OUT    a PEFT adapter folder (adapter_config.json + adapter_model.safetensors, transformers'
                         module names): PeftModel.from_pretrained(<the base transformers model>, OUT), vLLM
  merge CHECKPOINT OUT   a transformers folder of the model with its adapters merged into its weights

Adapters in PEFT's or PaddleFormers' folders start a run's adapters with run_finetune.py --lora_path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint.shards import EXPORT_DTYPES
from paddle_pp.interop.lora_adapters import export_merged, export_peft
from paddle_pp.runtime.errors import report_written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["peft", "merge"])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="the written tensors' dtype")
    parser.add_argument("--base_model_name_or_path", default=None,
                        help="peft: the base model the adapter config names (PEFT's base_model_name_or_path)")
    args = parser.parse_args(argv)
    if args.action == "peft":
        return report_written("lora.py", lambda: export_peft(args.checkpoint, args.target, args.dtype,
                                                             args.base_model_name_or_path))
    return report_written("lora.py", lambda: export_merged(args.checkpoint, args.target, dtype=args.dtype))

if __name__ == "__main__":
    sys.exit(main())
