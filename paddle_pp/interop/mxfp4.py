"""MXFP4 weights (GPT-OSS's released experts) dequantized as they are read.

The OCP microscaling format: values in blocks of 32 sharing one scale; each value an FP4 E2M1 code
(one nibble, the low nibble first), each scale an E8M0 byte s meaning 2^(s - 127). A GPT-OSS folder
saved quantized (`quantization_config: {quant_method: mxfp4}`) stores each expert tensor `<name>` as
`<name>_blocks` [E, rows, groups, 16] (uint8, two codes a byte) and `<name>_scales` [E, rows, groups]
(uint8), rows being the output width and groups x 32 the input width; the tensor they stand for is
[E, input, output], what a bf16 folder stores under `<name>`. Every value is a power of two times
one of 16 codes, so float32 (and bfloat16) hold it exactly: dequantizing loses nothing.
`with_mxfp4` puts a reader of `<name>` in place of each pair, which reads one expert's bytes when
a rank asks for one expert (a piece along axis 0).
"""

from __future__ import annotations

import numpy as np

from checkpoint.piece import WHOLE, Piece
from checkpoint.shards import ShardReader

BLOCKS, SCALES = "_blocks", "_scales"
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor [..., groups x 32, rows] that `blocks` [..., rows, groups, 16] and `scales`
    [..., rows, groups] hold."""
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    values[..., 1::2] = FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return np.ascontiguousarray(np.swapaxes(values.reshape(blocks.shape[:-2] + (-1,)), -1, -2))


class Mxfp4Reader:
    """Tensor `name` of a folder from its `_blocks` and `_scales` entries, as `ShardReader` reads a tensor."""

    def __init__(self, name: str, blocks: ShardReader, scales: ShardReader):
        self.name, self.blocks, self.scales = name, blocks, scales

    def shape(self, name: str) -> list[int]:
        *lead, rows, groups, pair = self.blocks.shape(name + BLOCKS)
        return [*lead, groups * 2 * pair, rows]

    def read(self, name: str, piece: Piece = WHOLE) -> np.ndarray:
        """`piece` of the dequantized tensor: a piece along the experts' axis from that piece's bytes only."""
        if piece.split and piece.axis == 0:
            along = Piece(0, piece.parts, piece.part)
            whole = dequantize(self.blocks.read(name + BLOCKS, along), self.scales.read(name + SCALES, along))
            return piece.flat_slice(whole)
        whole = dequantize(self.blocks.read(name + BLOCKS), self.scales.read(name + SCALES))
        return piece.flat_slice(np.ascontiguousarray(piece.cut(whole)))


def with_mxfp4(readers: dict[str, ShardReader]) -> dict[str, ShardReader | Mxfp4Reader]:
    """`readers` (tensor name -> its file's reader) with each `<name>_blocks` / `<name>_scales` pair
    replaced by one reader of `<name>`."""
    pairs = [key.removesuffix(BLOCKS) for key in readers
             if key.endswith(BLOCKS) and key.removesuffix(BLOCKS) + SCALES in readers]
    if not pairs:
        return readers
    merged = {key: reader for key, reader in readers.items()
              if key.removesuffix(BLOCKS).removesuffix(SCALES) not in pairs}
    return merged | {name: Mxfp4Reader(name, readers[name + BLOCKS], readers[name + SCALES]) for name in pairs}
