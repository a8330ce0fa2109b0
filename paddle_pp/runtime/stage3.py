"""How Paddle's sharding stage3 holds a parameter: as one flat slice per sharding rank (its
`fw_storage`), which the optimizer knows as "slice@<name>". The trainer (weight decay, clipping)
and the checkpoint (saving slices as single-card tensors) both read these facts."""

from __future__ import annotations

SLICE_PREFIX = "slice@"


def is_sliced(param) -> bool:
    """Stage3 sliced this parameter (it keeps only `fw_storage`, a flat piece)."""
    return getattr(param, "fw_storage", None) is not None


def slice_param_name(param) -> str:
    """The name the optimizer knows `param` by: its slice's under stage3, its own otherwise."""
    return SLICE_PREFIX + param.name if is_sliced(param) else param.name
