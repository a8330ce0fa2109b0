"""Move weights between our unified checkpoint and the Hugging Face transformers layout (every
registered family: LLaMA, Mistral, Qwen2/2.5, Qwen3, Gemma, GPT-2).

  export CHECKPOINT OUT   a transformers folder (their names and layouts, config.json); --dtype bfloat16|float16
  import FOLDER OUT       a single-card safetensors folder (our names) from a transformers or PaddleNLP one
                          (PaddleNLP's pickled model_state.pdparams too: --allow_unsafe_pickle, once, for a
                          folder you trust; the copy is data only)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpoint.shards import EXPORT_DTYPES
from paddle_pp.interop.pickled import ALLOW_UNSAFE_PICKLE_HELP
from paddle_pp.interop.transformers import export_hf, import_hf
from paddle_pp.runtime.errors import report_written
from paddle_pp.training.report import tensor_progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["export", "import"])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest output shard")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="weights' dtype (export)")
    parser.add_argument("--allow_unsafe_pickle", action="store_true", help=ALLOW_UNSAFE_PICKLE_HELP)
    args = parser.parse_args(argv)
    if args.direction == "import" and args.dtype != "float32":
        parser.error("--dtype applies to export; import keeps the folder's weights as float32")
    total = sum(p.stat().st_size for p in args.source.glob("model*.safetensors"))

    def write() -> Path:
        with tensor_progress(total, args.direction) as on_tensor:
            max_shard_bytes = int(args.max_shard_gb * (1 << 30))
            return export_hf(args.source, args.target, max_shard_bytes, on_tensor, args.dtype) \
                if args.direction == "export" else import_hf(args.source, args.target, max_shard_bytes, on_tensor,
                                                                  args.allow_unsafe_pickle)

    return report_written("convert_hf.py", write)


if __name__ == "__main__":
    sys.exit(main())
