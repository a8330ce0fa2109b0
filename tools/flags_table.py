"""Write docs/flags.md, the table of every run_pretrain.py flag, from the argument groups.

  .venv/bin/python tools/flags_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from paddle_pp.training.arguments import flags_document

DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def main() -> int:
    DOC.write_text(flags_document())
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
