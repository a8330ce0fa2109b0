"""Block-scaled FP8 weights (DeepSeek-V3/R1's, Kimi-K2's, the "-FP8" releases) dequantized as they are read.

A folder saved so (`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128,
128]}`) stores a linear weight `<name>` [out, in] as float8 e4m3 and beside it `<name>_scale_inv`
[ceil(out / 128), ceil(in / 128)] in float32, one factor per 128 x 128 block (the last blocks cut
short): the weight is each code widened to float32 times its block's factor, one float32 rounding,
as transformers dequantizes it. `with_fp8` puts a reader of the dequantized weight in place of each
pair; the model then trains and saves in float32, unquantized.
"""

from __future__ import annotations

import numpy as np

from checkpoint.piece import WHOLE, Piece
from checkpoint.shards import ShardReader

SCALE_INV = "_scale_inv"


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`weight` [..., rows, cols] (float32 holding the codes' values) times each block's factor."""
    rows, cols = weight.shape[-2:]
    factors = np.repeat(np.repeat(scale_inv, block[0], axis=-2)[..., :rows, :], block[1], axis=-1)[..., :cols]
    return weight * factors.astype(np.float32)


class Fp8Reader:
    """Tensor `name` dequantized from its float8 entry and its `_scale_inv` entry."""

    def __init__(self, name: str, weights: ShardReader, scales: ShardReader, block: tuple[int, int]):
        self.name, self.weights, self.scales, self.block = name, weights, scales, block

    def shape(self, name: str) -> list[int]:
        return self.weights.shape(name)

    def read(self, name: str, piece: Piece = WHOLE) -> np.ndarray:
        whole = dequantize(self.weights.read(name), self.scales.read(name + SCALE_INV), self.block)
        return piece.flat_slice(np.ascontiguousarray(piece.cut(whole)))


def with_fp8(readers: dict, block: tuple[int, int] | None) -> dict:
    """`readers` with each `<name>` / `<name>_scale_inv` pair replaced by one reader of `<name>`
    (unchanged without a block size: the folder is not block-scaled FP8)."""
    pairs = [key for key in readers if block is not None and key + SCALE_INV in readers]
    if not pairs:
        return readers
    kept = {key: reader for key, reader in readers.items()
            if key not in pairs and key.removesuffix(SCALE_INV) not in pairs}
    return kept | {name: Fp8Reader(name, readers[name], readers[name + SCALE_INV], block) for name in pairs}
