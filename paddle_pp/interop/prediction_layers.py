"""Multi-token prediction layers a folder's config counts but its files do not hold.

transformers builds DeepSeek-V3 and GLM-4.5 without their prediction layers and saves what it built:
every folder it saved (every fine-tune made with it) keeps `num_nextn_predict_layers` in config.json
and holds no layer past the decoder's last. Such a folder trains without them, as transformers reads
it, and the run says so; `--fresh_prediction_layers` trains them from fresh weights instead (the
model's own initialisation, drawn per tensor name, so every layout starts them alike).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modeling.registry import plan_of

PREDICTION_FIELD = "num_nextn_predict_layers"  # our name of the count (GLM's `num_mtp_layers` is read into it)
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Absent:
    """What a run makes of a folder without its prediction layers."""

    config: dict  # the config to build: without them, or as counted when they start fresh
    fresh: tuple[str, ...]  # our names of the tensors a run initialises instead of reading
    note: str


def prediction_layer_names(config) -> list[str]:
    """Our names of the tensors of the layers after the decoder's last: the prediction layers."""
    return [name for name in plan_of(config)
            if (match := _LAYER.search(name)) and int(match.group(1)) >= config.num_hidden_layers]


def absent_prediction_layers(folder: Path, config: dict, ours, holds: Callable[[str], bool],
                             fresh: bool) -> Absent | None:
    """None when `config` (built: `ours`) counts no prediction layer or the folder holds some (`holds`:
    whether it stores the tensor of one of our names); else the run's config, the tensors it starts
    fresh and its note."""
    names = prediction_layer_names(ours) if ours.mtp_depth else []
    if not names or any(holds(name) for name in names):
        return None
    depth = ours.mtp_depth
    counted = (f"{folder}/config.json counts {depth} multi-token prediction layer{'s' * (depth > 1)} "
               f"({PREDICTION_FIELD}) that the folder does not hold (transformers saves its models without them)")
    if fresh:
        return Absent(config, tuple(names), f"{counted}: they train from fresh weights (--fresh_prediction_layers)")
    return Absent({**config, PREDICTION_FIELD: 0}, (), f"{counted}: training without them, as transformers reads "
                  "the folder; --fresh_prediction_layers trains them from fresh weights")
