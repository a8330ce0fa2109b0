"""Freed host memory kept by the process, so that a fresh CPU tensor does not page-fault.

Paddle 3.3.1's CPU allocator hands every large tensor to glibc's malloc, and glibc's defaults give
big blocks back to the kernel as soon as they are freed: blocks above the mmap threshold are
unmapped, and the top of the heap is trimmed past 128 KiB. The next tensor of the same size is then
mapped afresh and every 4 KiB page of it faults and is zeroed on first touch. On CPU training every
op makes a fresh output, so elementwise ops ran at the page-fault rate: `relu` of a
[1, 3, 1536, 512] fp32 tensor took 8.9 ms and of a [4, 1024, 12000] one 174 ms, 0.9 and 28 ms once
freed blocks stay in the process (`bench/denormals.py` prints the same comparison on its CPU).

`keep_freed_memory` sets glibc's `mallopt(M_MMAP_MAX, 0)` (every block from the heap, none unmapped
on free) and `M_TRIM_THRESHOLD` to 1 GiB (the heap's top is kept up to that), as the caching
allocator of a GPU keeps device memory: the process's resident size stays at its peak instead of
falling between steps. Done at import of `paddle_pp`, before any tensor; on a C library without
`mallopt` (not glibc) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
KEPT_TOP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Keep freed blocks in the process (glibc only); whether the settings were taken."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_TOP_BYTES))


def host_bytes_per_rank(world_size: int) -> int:
    """This machine's physical memory over the ranks on it: those `paddle.distributed.launch` started
    here, or (a plan made outside a launch) the whole world's."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total // max(1, int(os.environ.get("PADDLE_LOCAL_SIZE", world_size)))
