"""transformers 5's in-memory layout of a mixture-of-experts layer, which its
`save_pretrained(save_original_format=False)` writes and its `from_pretrained` reads back: every
expert of a layer stacked, gate and up fused, `experts.gate_up_proj` [E, 2 x width, hidden] (each
expert's gate rows, then its up rows; [out, in] as every transformers linear) and
`experts.down_proj` [E, hidden, width], in a block named `mlp` in every family (Mixtral's
`block_sparse_moe` too, router included; ERNIE 4.5's `moe_statics` inside the gate: a config's
`fused_layout_renames`). Both versions' default save writes one tensor per expert
(what our export writes); a folder holding the fused names is read through this map.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable

from modeling.transformers_adapter import Stored

GATE_UP, DOWN = "gate_up_proj", "down_proj"
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def stores_fused_experts(names: Iterable[str]) -> bool:
    """Whether a folder's tensor names are the fused layout's."""
    return any(name.endswith(f".experts.{GATE_UP}") for name in names)


def fused_expert_stored(stored: Stored, config) -> Stored:
    """Where the fused layout keeps the tensor that the per-expert layout stores as `stored`."""
    name = stored.name.replace(f".{config.moe_block}.", ".mlp.")
    for per_expert, fused in getattr(config, "fused_layout_renames", {}).items():  # ERNIE's bias moves into the gate
        if name.endswith(per_expert):
            name = name.removesuffix(per_expert) + fused
    return stacked_expert(replace(stored, name=name), config)


def stacked_expert(stored: Stored, config) -> Stored:
    """Where the stacked experts `experts.gate_up_proj` / `experts.down_proj` keep the tensor stored per
    expert as `stored` (`...experts.{e}.{gate,up,down}.weight`); any other tensor where it is."""
    match = _PER_EXPERT.fullmatch(stored.name)
    if match is None:
        return stored
    experts, index, projection = match.groups()
    gate, up, down = config.expert_names
    stack = (int(index), config.num_experts)
    if projection == down:
        return replace(stored, name=f"{experts}.{DOWN}", stack=stack)
    return replace(stored, name=f"{experts}.{GATE_UP}", stack=stack, axis=0, part=(gate, up).index(projection), parts=2)
