"""Steps whose global batches are skipped (`--skip_data_intervals`), e.g. to step over the data
behind a loss spike: the step counter, the data position and the schedule still advance, so every
later step reads exactly the batch it would have, and checkpoints carry the intervals on."""

from __future__ import annotations

import json

from paddle_pp.runtime.errors import UserError


class SkipIntervalsError(UserError, ValueError):
    """`--skip_data_intervals` that is not a list of [first, last] steps."""


def parse_intervals(text: str) -> list[tuple[int, int]]:
    """'[[a, b], ...]' (1-based steps, both ends included) -> sorted intervals; '' -> none."""
    if not text.strip():
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise SkipIntervalsError(f"--skip_data_intervals {text!r} is not JSON ({err}); write e.g. '[[100, 120]]'") from err
    if not isinstance(value, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) for v in pair) and 1 <= pair[0] <= pair[1]
            for pair in value):
        raise SkipIntervalsError(f"--skip_data_intervals {text!r} must be a list of [first, last] steps with "
                                 "1 <= first <= last, e.g. '[[100, 120], [300, 300]]'")
    return merge(value)


def merge(*lists) -> list[tuple[int, int]]:
    """The union of interval lists (a checkpoint's and the command line's), sorted."""
    return sorted({(int(a), int(b)) for intervals in lists for a, b in intervals})


def skipped(step: int, intervals: list[tuple[int, int]]) -> bool:
    return any(a <= step <= b for a, b in intervals)
