"""Released weights stored quantized, dequantized exactly as they are read (then trained and saved
unquantized): GPT-OSS's MXFP4 experts and the block-scaled FP8 of DeepSeek-V3/R1, Kimi-K2 and the
"-FP8" releases. Each format stores a tensor as a pair of entries; `dequantizing` puts one reader of
the tensor in place of each pair, with `ShardReader`'s interface (`shape`, `read` of a `Piece`).

MXFP4 (the OCP microscaling format): values in blocks of 32 sharing one scale; each value an FP4
E2M1 code (one nibble, the low nibble first), each scale an E8M0 byte s meaning 2^(s - 127). A
GPT-OSS folder (`quantization_config: {quant_method: mxfp4}`) stores each expert tensor `<name>` as
`<name>_blocks` [E, rows, groups, 16] (uint8, two codes a byte) and `<name>_scales` [E, rows,
groups], rows being the output width and groups x 32 the input width; the tensor they stand for is
[E, input, output], what a bf16 folder stores under `<name>`. Every value is a power of two times
one of 16 codes, so float32 holds it exactly. A rank asking for one expert (a piece along axis 0)
reads only that expert's bytes.

Block-scaled FP8 (`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128,
128]}`): a linear weight `<name>` [out, in] in float8 e4m3 and beside it `<name>_scale_inv`
[ceil(out / 128), ceil(in / 128)] in float32, one factor per block (the last blocks cut short): the
weight is each code widened to float32 times its block's factor, one float32 rounding, as
transformers dequantizes it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from checkpoint.piece import WHOLE, Piece
from checkpoint.shards import ShardReader

BLOCKS, SCALES, SCALE_INV = "_blocks", "_scales", "_scale_inv"
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor [..., groups x 32, rows] that `blocks` [..., rows, groups, 16] and `scales`
    [..., rows, groups] hold."""
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    values[..., 1::2] = FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return np.ascontiguousarray(np.swapaxes(values.reshape(blocks.shape[:-2] + (-1,)), -1, -2))


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`weight` [..., rows, cols] (float32 holding the codes' values) times each block's factor."""
    rows, cols = weight.shape[-2:]
    factors = np.repeat(np.repeat(scale_inv, block[0], axis=-2)[..., :rows, :], block[1], axis=-1)[..., :cols]
    return weight * factors.astype(np.float32)


class Mxfp4Reader:
    """A tensor from its `_blocks` and `_scales` entries (each in its file's reader)."""

    def __init__(self, blocks: ShardReader, scales: ShardReader):
        self.blocks, self.scales = blocks, scales

    def shape(self, name: str) -> list[int]:
        *lead, rows, groups, pair = self.blocks.shape(name + BLOCKS)
        return [*lead, groups * 2 * pair, rows]

    def read(self, name: str, piece: Piece = WHOLE) -> np.ndarray:
        """`piece` of the tensor; a piece along the experts' axis is dequantized from its bytes only."""
        by_expert = piece.split and piece.axis == 0
        along = piece.tp_piece if by_expert else WHOLE
        whole = dequantize_mxfp4(self.blocks.read(name + BLOCKS, along), self.scales.read(name + SCALES, along))
        return _cut(whole, piece.in_tp_piece if by_expert else piece)


class Fp8Reader:
    """A tensor from its float8 entry and its `_scale_inv` entry (each in its file's reader)."""

    def __init__(self, weights: ShardReader, scales: ShardReader, block: tuple[int, int]):
        self.weights, self.scales, self.block = weights, scales, block

    def shape(self, name: str) -> list[int]:
        return self.weights.shape(name)

    def read(self, name: str, piece: Piece = WHOLE) -> np.ndarray:
        return _cut(dequantize_fp8(self.weights.read(name), self.scales.read(name + SCALE_INV), self.block), piece)


def _cut(whole: np.ndarray, piece: Piece) -> np.ndarray:
    return piece.flat_slice(np.ascontiguousarray(piece.cut(whole)))


def _paired(readers: dict, codes: str, scales: str, make: Callable[[ShardReader, ShardReader], object]) -> dict:
    """`readers` with each `<name><codes>` / `<name><scales>` pair replaced, under `<name>`, by
    `make(the codes' reader, the scales' reader)`."""
    names = [key.removesuffix(codes) for key in readers
             if key.endswith(codes) and key.removesuffix(codes) + scales in readers]
    taken = {name + suffix for name in names for suffix in (codes, scales)}
    return {key: reader for key, reader in readers.items() if key not in taken} | {
        name: make(readers[name + codes], readers[name + scales]) for name in names}


def dequantizing(readers: dict[str, ShardReader], quantization: dict | None) -> dict:
    """`readers` (tensor name -> its file's reader) with every quantized tensor read as the tensor it
    holds: MXFP4 pairs always, FP8 ones when `quantization` (the config's) gives their block size."""
    readers = _paired(readers, BLOCKS, SCALES, Mxfp4Reader)
    quantization = quantization or {}
    if quantization.get("quant_method") != "fp8" or not quantization.get("weight_block_size"):
        return readers
    block = tuple(quantization["weight_block_size"])
    return _paired(readers, "", SCALE_INV, lambda codes, scales: Fp8Reader(codes, scales, block))
