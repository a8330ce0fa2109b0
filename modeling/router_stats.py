"""What a rank's mixture-of-experts layers routed, for the trainer's metrics: per layer the aux loss
of each forward call, the tokens each expert received, and how near routing came to a tie. Lives apart from the model so the run's
`Execution` can carry it without importing the blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import paddle


@dataclass
class RouterStats:
    """What the MoE layers of one rank routed since the trainer last read it: per layer, the aux
    loss of each forward call and the tokens each expert received (summed). A recomputed layer
    records the same values again, which leaves means and shares unchanged."""

    aux: dict[int, list[paddle.Tensor]] = field(default_factory=dict)
    load: dict[int, paddle.Tensor] = field(default_factory=dict)
    margins: list[paddle.Tensor] = field(default_factory=list)  # least top-k / next router-logit gap per call

    def record(self, layer: int, aux: paddle.Tensor, counts: paddle.Tensor, margin: paddle.Tensor) -> None:
        self.aux.setdefault(layer, []).append(aux.detach())
        self.load[layer] = self.load[layer] + counts if layer in self.load else counts
        self.margins.append(margin)

    def take(self) -> tuple[dict[int, list[paddle.Tensor]], dict[int, paddle.Tensor], float]:
        """(aux losses by layer, expert counts by layer, least margin) since the last call; cleared."""
        margin = min((float(m) for m in self.margins), default=float("inf"))
        taken = (self.aux, self.load, margin)
        self.aux, self.load, self.margins = {}, {}, []
        return taken
