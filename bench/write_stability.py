"""Why single saves vary on one machine, and what O_DIRECT does about it, side by side in one run.

Writes the same `--gb` of bytes `--repeats` times, alternating: buffered (`write` then `fsync`,
what `write_shard` did before) and O_DIRECT through aligned bounce buffers
(`checkpoint.shards.DirectWriter`, what it does now); each file is deleted after its repeat, as
`--save_total_limit` rotation deletes old checkpoints. Prints, per method, every repeat split into
the time spent in write() and in fsync, and the spread (slowest / fastest); writes
bench/results/write_stability.json.

  .venv/bin/python bench/write_stability.py --gb 1 --repeats 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import machine, write_report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK = 64 << 20


def buffered(path: Path, data: np.ndarray) -> tuple[float, float]:
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for first in range(0, data.size, CHUNK):
            handle.write(data[first:first + CHUNK].data)
        handle.flush()
        written = time.perf_counter()
        os.fsync(handle.fileno())
    return written - started, time.perf_counter() - written


def direct(path: Path, data: np.ndarray) -> tuple[float, float]:
    from checkpoint.shards import DirectWriter

    started = time.perf_counter()
    writer = DirectWriter(path)
    for first in range(0, data.size, CHUNK):
        writer.write(data[first:first + CHUNK].data)
    written = time.perf_counter()
    writer.close()  # the last writes, then fsync
    return written - started, time.perf_counter() - written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp folder on /tmp's disk)")
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/write_stability.json")
    args = parser.parse_args(argv)
    data = np.random.default_rng(0).integers(0, 255, int(args.gb * 2**30), dtype=np.uint8)
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    methods = {"buffered write + fsync": buffered, "O_DIRECT (DirectWriter)": direct}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, method in methods.items():
            path = folder / "file"
            runs[name].append(method(path, data))
            path.unlink()
    folder.rmdir()
    report = {"machine": machine(), "measured": time.strftime("%Y-%m-%d"), "gb": args.gb, "methods": {}}
    for name, times in runs.items():
        totals = [w + f for w, f in times]
        report["methods"][name] = {"write_s": [w for w, _ in times], "fsync_s": [f for _, f in times],
                                   "median_s": statistics.median(totals), "spread": max(totals) / min(totals)}
        spread = max(totals) / min(totals)
        print(f"{name:>24}: median {statistics.median(totals):.2f} s, slowest/fastest {spread:.1f}x; "
              + ", ".join(f"{w:.2f}+{f:.2f}" for w, f in times) + " (write()+fsync s)")
    print(f"({report['machine']['cpu']}, {report['machine']['cores']} cores, {args.gb} GB per repeat)")
    write_report(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
