"""Tensors a folder stores apart but may cut anywhere: a group whose concatenation along the first
axis is what matters, each member read as our sizes cut it.

transformers 5.23 loads Olmo-Hybrid's `q_conv1d`, `k_conv1d` and `v_conv1d` by concatenating them
into one conv over q | k | v, and saves that conv back in three equal thirds (`torch.chunk`), so a
folder it saved stores 43 | 43 | 42 channels where the model's q, k and v have 32 | 32 | 64. Read as
stored, such a folder would fail the shape check; read through `recut`, each member is its own
channels of the concatenation, as in the released folders (and ours), whose members are already cut
so.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from modeling.placement import split_tensor

Read = Callable[[str, int | None, int, int], np.ndarray]  # (name, TP axis, parts, part) -> this rank's piece


def recut(shapes: dict[str, list[int]], read: Read, groups: tuple[tuple[str, ...], ...],
          expected: dict[str, list[int]]) -> tuple[dict[str, list[int]], Read]:
    """`shapes` and `read` with every group's members (name suffixes in `groups`, under one prefix)
    cut as `expected` says, where the folder cut them otherwise along the first axis."""
    spans: dict[str, tuple[list[str], int, int]] = {}  # member -> (the group's stored names, start, width)
    for suffixes in groups:
        for key in shapes:
            if not key.endswith(suffixes[0]):
                continue
            members = [key[:-len(suffixes[0])] + suffix for suffix in suffixes]
            if not all(m in shapes and m in expected for m in members) or \
                    all(shapes[m] == expected[m] for m in members):
                continue
            if sum(shapes[m][0] for m in members) != sum(expected[m][0] for m in members) or \
                    any(shapes[m][1:] != expected[m][1:] for m in members):
                continue  # not a recut of the same concatenation: the shape check names it
            start = 0
            for member in members:
                spans[member] = (members, start, expected[member][0])
                start += expected[member][0]
    if not spans:
        return shapes, read

    def recut_read(name: str, axis: int | None, parts: int, part: int) -> np.ndarray:
        if name not in spans:
            return read(name, axis, parts, part)
        members, start, width = spans[name]
        whole = np.concatenate([read(member, None, 1, 0) for member in members])
        return split_tensor(whole[start:start + width], axis, parts, part)

    return {**shapes, **{name: expected[name] for name in spans}}, recut_read
