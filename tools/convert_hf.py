"""Move weights between our unified checkpoint and the Hugging Face transformers layout (LLaMA).

  export CHECKPOINT OUT   a transformers folder (torch names, [out, in] linears, config.json)
  import HF_FOLDER OUT    a single-card folder our LlamaForCausalLM and the trainer's loader read
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint.hf import export_hf, import_hf
from paddle_pp.runtime.errors import UserError
from paddle_pp.training.report import tensor_progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["export", "import"])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest output shard")
    args = parser.parse_args(argv)
    convert = export_hf if args.direction == "export" else import_hf
    total = sum(p.stat().st_size for p in args.source.glob("model*.safetensors"))
    try:
        with tensor_progress(total, args.direction) as on_tensor:
            out = convert(args.source, args.target, int(args.max_shard_gb * (1 << 30)), on_tensor)
    except (UserError, FileNotFoundError) as err:
        print(f"convert_hf.py: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
