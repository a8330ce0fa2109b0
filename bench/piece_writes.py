"""How tp ranks write their pieces of column-split tensors into one shared file, side by side.

4 processes in tp2 pairs; each pair fills one shard of `--tensors` tensors of `--rows` rows, every
row split in two runs of `--run_bytes` (by default 1 MB tensors of 1 KB runs: q, k and v of a
hidden-512 model in fp32 at tp2), each process writing its run of every row, alternating the
methods `--repeats` times:
- `PieceWriter` (`checkpoint.shards`, what a save runs): each file's blocks allocated (fallocate),
  one shared mapping per file, short runs copied through it, the CRC-32 state of every piece
  computed, fsync at the end;
- the same without allocating the blocks first;
- the same with a mapping per tensor, no allocation either (what the first version did);
- the same with a positioned write per run (`MAPPED_RUN_BYTES = 0`: what a file system without
  shared writable mappings gets, and what long runs take);
- the bound: each process writing its bytes contiguously to a file of its own (pwrite + fsync).
Prints the median seconds of the slowest process and writes bench/results/piece_writes.json.

  .venv/bin/python bench/piece_writes.py --tensors 256 --rows 512 --run_bytes 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
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

TP, PROCESSES = 2, 4


def _per_tensor_mapping(writer, path: Path, file_size: int, offset: int, runs: np.ndarray, stride: int,
                        lead: int) -> bool:
    """The first version: the tensor's pages mapped, copied into, unmapped."""
    start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(writer.fds[path], offset + len(runs) * stride - start, offset=start)
    view = np.frombuffer(mapped, np.uint8, len(runs) * stride, offset - start).reshape(len(runs), stride)
    view[:, lead:lead + runs.shape[1]] = runs
    del view
    mapped.close()
    return True


def _write(method: str, folder: Path, rank: int, args: argparse.Namespace) -> None:
    from checkpoint.piece import Piece
    from checkpoint.shards import PieceWriter

    pair, part = divmod(rank, TP)
    piece = np.full((args.rows, args.run_bytes // 4), rank + 1, np.float32)
    tensor_bytes = piece.nbytes * TP
    if method == "own contiguous file":
        fd = os.open(folder / f"own{rank}", os.O_WRONLY | os.O_CREAT)
        for index in range(args.tensors):
            os.pwrite(fd, piece.data, index * piece.nbytes)
        os.fsync(fd)
        os.close(fd)
        return
    writer = PieceWriter()
    if method in ("no fallocate", "mapping per tensor"):  # each method runs in a process of its own
        import checkpoint.shards

        checkpoint.shards._fallocate = lambda fd, size: 0
    if method == "mapping per tensor":
        writer._mapped_copy = lambda *a: _per_tensor_mapping(writer, *a)
    if method == "write per run":
        writer.MAPPED_RUN_BYTES = 0
    for index in range(args.tensors):
        writer.write(folder / f"pair{pair}", args.tensors * tensor_bytes, index * tensor_bytes,
                     (args.rows, TP * piece.shape[1]), Piece(1, TP, part), piece)
    writer.close()


def _process(method: str, folder: Path, rank: int, args, barrier, results) -> None:
    barrier.wait()
    started = time.perf_counter()
    _write(method, folder, rank, args)
    results.put(time.perf_counter() - started)


METHODS = ("PieceWriter", "no fallocate", "mapping per tensor", "write per run", "own contiguous file")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--run_bytes", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPO / "bench/results/piece_writes.json")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {method: [] for method in METHODS}
    context = mp.get_context("fork")
    for _ in range(args.repeats):
        for method in METHODS:
            with tempfile.TemporaryDirectory(prefix="piece_writes_") as folder:
                barrier, results = context.Barrier(PROCESSES), context.Queue()
                processes = [context.Process(target=_process, args=(method, Path(folder), rank, args, barrier,
                                                                     results)) for rank in range(PROCESSES)]
                for process in processes:
                    process.start()
                times = [results.get() for _ in processes]
                for process in processes:
                    process.join()
                    if process.exitcode:
                        raise RuntimeError(f"{method}: a writer failed")
                seconds[method].append(max(times))
    total_gb = PROCESSES * args.tensors * args.rows * args.run_bytes / 1e9
    report = {**machine(), "measured": time.strftime("%Y-%m-%d"), "gb_written": total_gb, "args": vars(args) | {
        "output": str(args.output)}, "seconds": seconds}
    print(f"{PROCESSES} processes (tp{TP} pairs) writing {total_gb:.2f} GB in {args.run_bytes}-byte runs "
          f"({report['cpu']}, {report['cores']} cores); median of {args.repeats}, slowest process:")
    for method, values in seconds.items():
        print(f"  {method:>20}: {statistics.median(values):6.3f} s  ({min(values):.3f}-{max(values):.3f})")
    write_report(args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
