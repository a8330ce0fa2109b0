"""Multimodal transformers folders whose language model is a registered text family's model (Qwen3.5's
`qwen3_5`: the text model under `model.language_model.`, the vision tower under `model.visual.`): the
text config (`text_config`) and weights are what trains; every tensor under a `carried` prefix is
carried through the checkpoints and written back bit for bit (`paddle_pp/interop/carried.py`), so a
checkpoint saved in transformers' layout, and an export, is the multimodal folder transformers loads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from modeling.transformers_adapter import Stored

BODY = "model."  # where a text family's transformers folders keep everything but the head


@dataclass(frozen=True)
class Multimodal:
    """A multimodal folder kind: its `model_type` and class, its language model's model_type, where
    that model's body sits (`text_body`, for the text folders' "model."), and the name prefixes of the
    other parts' tensors (`carried`)."""

    model_type: str
    architecture: str
    text_model_type: str
    text_body: str = "model.language_model."
    carried: tuple[str, ...] = ("model.visual.",)

    def stored(self, stored: Stored) -> Stored:
        """Where this kind's folders keep a text model's tensor that its own folders keep at `stored`."""
        if not stored.name.startswith(BODY):
            return stored  # the head
        return replace(stored, name=self.text_body + stored.name.removeprefix(BODY))


MULTIMODAL = {kind.model_type: kind for kind in (
    Multimodal("qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    Multimodal("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"))}
