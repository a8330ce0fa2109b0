"""What every benchmark records next to its numbers: ratios differ between machines."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))}


def write_report(path: Path, report: dict) -> None:
    """A benchmark's results as JSON at `path` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
