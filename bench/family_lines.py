"""Lines of code a model family costs: its folder under modeling/ (declaration and family-only code),
now and at an earlier commit, beside the shared code every family builds on.

A family folder is everything written for that family alone; the shared rest (blocks, the generic
single-card/TP and pipeline models, the TP plan rules) is counted once. Lines are non-blank lines
of Python, docstrings and comments included (they are part of what a newcomer reads).

  .venv/bin/python bench/family_lines.py --before 307b2a0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_FOLDERS = ("blocks", "attention_core")  # folders under modeling/ that every family builds on


def _files(revision: str | None) -> dict[str, str]:
    """Every modeling/*.py path and its text at `revision` (None: the working tree)."""
    if revision is None:
        return {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "modeling").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", revision, "modeling"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{revision}:{name}"], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout for name in names if name.endswith(".py")}


def count(revision: str | None) -> dict[str, int]:
    """Non-blank lines per family folder, and "shared" for the rest of modeling/."""
    lines: dict[str, int] = {}
    for path, text in _files(revision).items():
        parts = Path(path).parts
        owner = parts[1] if len(parts) > 2 and parts[1] not in SHARED_FOLDERS else "shared"
        lines[owner] = lines.get(owner, 0) + sum(1 for line in text.splitlines() if line.strip())
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="307b2a0", help="git revision to compare with")
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/family_lines.json")
    args = parser.parse_args(argv)
    before, after = count(args.before), count(None)
    print(f"{'':10} {'before':>8} {'now':>8}")
    for owner in sorted(set(before) | set(after), key=lambda o: (o == "shared", o)):
        print(f"{owner:10} {before.get(owner, '-'):>8} {after.get(owner, '-'):>8}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "before": args.before,
                                       "lines_before": before, "lines_now": after}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
