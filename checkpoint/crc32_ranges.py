"""CRC-32 of a file whose byte ranges were written by different processes, without any of them
reading the others' bytes.

zlib's CRC-32 is affine over GF(2): with `state` the register inside zlib (the public value XOR
0xFFFFFFFF), reading bytes B from state c gives A_n(c) XOR P(B), where A_n, the effect of n zero
bytes, is a 32x32 bit matrix that depends only on n = len(B), and P is linear in B. So a file
equals the XOR of copies of itself in which all bytes but one writer's are zero, and each writer
can sum its own ranges (`piece_state`, holes as zeros) while the file's owner sums the rest with
those ranges as zeros (`skip`); the owner's checksum and the pieces' states give the file's
exact CRC-32 (`combine`), the same number zlib computes over the finished file. This is zlib's
crc32_combine, applied to holes: zlib does not expose it to Python.

A matrix is kept as four 256-entry tables, one per byte of the state, so applying it is four
lookups; tables for A_(2^k) are squared up once per process, A_n is composed from them.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

FLIP = 0xFFFFFFFF  # zlib's register is the public CRC-32 XOR this
_BITS = np.arange(256)


def _tables(columns: list[int]) -> np.ndarray:
    """The 4 x 256 lookup tables of the matrix whose column j is `columns[j]` (the image of bit j)."""
    tables = np.zeros((4, 256), np.uint32)
    for j, column in enumerate(columns):
        tables[j // 8, (_BITS >> (j % 8)) & 1 == 1] ^= np.uint32(column)
    return tables


def _apply(tables: np.ndarray, state):
    """The matrix times `state` (an int, or a uint32 array elementwise)."""
    if isinstance(state, np.ndarray):
        return tables[0][state & 255] ^ tables[1][(state >> 8) & 255] ^ tables[2][(state >> 16) & 255] ^ \
            tables[3][state >> 24]
    return int(tables[0][state & 255] ^ tables[1][(state >> 8) & 255] ^ tables[2][(state >> 16) & 255]
               ^ tables[3][state >> 24])


@lru_cache(maxsize=None)
def _power(k: int) -> np.ndarray:
    """A_(2^k): one zero byte from zlib, then repeated squaring."""
    if k == 0:
        return _tables([zlib.crc32(b"\0", (1 << j) ^ FLIP) ^ FLIP for j in range(32)])
    half = _power(k - 1)
    return _tables([_apply(half, _apply(half, 1 << j)) for j in range(32)])


def _advance(state: int, n: int) -> int:
    """A_n(state): the register after n zero bytes."""
    k = 0
    while n:
        if n & 1:
            state = _apply(_power(k), state)
        n, k = n >> 1, k + 1
    return state


@lru_cache(maxsize=256)
def _zeros(n: int) -> np.ndarray:
    """A_n as tables, for applying one n to many states."""
    return _tables([_advance(1 << j, n) for j in range(32)])


def skip(crc: int, n: int) -> int:
    """The public CRC-32 `crc` continued over n zero bytes (= zlib.crc32(bytes(n), crc), without the bytes)."""
    return _advance(crc ^ FLIP, n) ^ FLIP


def piece_state(runs: np.ndarray, stride: int, lead: int, length: int) -> int:
    """The register, started at zero, after a range of `length` bytes that is zero except for
    `runs` (uint8, one row per run): run i starts at byte lead + i * stride. A TP piece of a
    tensor split along an inner axis is such a set of runs inside the single-card tensor."""
    rows, run = runs.shape
    if rows == 0:
        return 0
    states = np.array([zlib.crc32(row, FLIP) ^ FLIP for row in runs], np.uint32)
    span = stride
    while len(states) > 1:  # pairwise: earlier runs travel `span` more bytes than the next one
        if len(states) % 2:
            states = np.concatenate([np.zeros(1, np.uint32), states])
        states = _apply(_zeros(span), states[0::2]) ^ states[1::2]
        span *= 2
    last_end = lead + (rows - 1) * stride + run
    return _advance(int(states[0]), length - last_end)


def combine(crc: int, pieces: list[tuple[int, int]]) -> int:
    """The file's CRC-32 from its owner's `crc` (written ranges only, the others skipped as zeros)
    and each range written elsewhere as (register from `piece_state`, bytes from the range's end to
    the file's end)."""
    state = crc ^ FLIP
    for piece, after in pieces:
        state ^= _advance(piece, after)
    return state ^ FLIP
