"""Multimodal transformers folders whose language model is a registered text family's model (Qwen3.5's
`qwen3_5`: the text model under `model.language_model.`, the vision tower under `model.visual.`; Gemma 3's
`gemma3`, whose folders keep the names of its first release, which transformers saves them under still: the
text model under `language_model.model.`, its head `language_model.lm_head`, the SigLIP tower under
`vision_tower.` and the projector beside; Gemma 4's `gemma4`, the text model under `model.language_model.`
beside its vision (and, E2B/E4B, audio) tower and their embedders; Kimi K2.5's `kimi_k25`, a DeepSeek-V3 text model under the same
names beside the MoonViT tower and its projector; Llama 4's `llama4`, beside its vision model and
projector; Mistral's `mistral3`, a Mistral (Small 3.x) or Mistral 4 (Small 4) text model beside Pixtral): the
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
    that model's body sits (`text_body`, for the text folders' "model.") and its head (`text_head`
    before the text folders' "lm_head."), the name prefixes of the other parts' tensors (`carried`), and
    the text config's other model_types (`text_aliases`)."""

    model_type: str
    architecture: str
    text_model_type: str
    text_body: str = "model.language_model."
    carried: tuple[str, ...] = ("model.visual.",)
    text_head: str = ""
    text_aliases: tuple[str, ...] = ()  # other model_types its folders' text config may have (an alias, another family)
    resaved: tuple[str, str] | None = None  # (released prefix, the prefix transformers saves it under instead)

    def as_released(self, name: str) -> str:
        """A folder's tensor name as the released folders spell it (transformers 5.23 saves Kimi K2.5's
        text layers as `language_model.model.blocks.*`: its rename of the vision tower's `blocks` to
        `layers` is reversed on every name; it loads both)."""
        if self.resaved is not None and name.startswith(self.resaved[1]):
            return self.resaved[0] + name.removeprefix(self.resaved[1])
        return name

    def stored(self, stored: Stored) -> Stored:
        """Where this kind's folders keep a text model's tensor that its own folders keep at `stored`."""
        if not stored.name.startswith(BODY):
            return replace(stored, name=self.text_head + stored.name)  # the head
        return replace(stored, name=self.text_body + stored.name.removeprefix(BODY))


MULTIMODAL = {kind.model_type: kind for kind in (
    Multimodal("qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    Multimodal("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
    Multimodal("gemma3", "Gemma3ForConditionalGeneration", "gemma3_text", text_body="language_model.model.",
               carried=("vision_tower.", "multi_modal_projector."), text_head="language_model."),
    Multimodal("kimi_k25", "Kimi_K25ForConditionalGeneration", "deepseek_v3", text_body="language_model.model.",
               carried=("vision_tower.", "mm_projector.", "model.mm_projector."), text_head="language_model.",
               text_aliases=("kimi_k2",), resaved=("language_model.model.layers.", "language_model.model.blocks.")),
    Multimodal("gemma4", "Gemma4ForConditionalGeneration", "gemma4_text",
               carried=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")),
    Multimodal("llama4", "Llama4ForConditionalGeneration", "llama4_text", text_body="language_model.model.",
               carried=("vision_model.", "multi_modal_projector."), text_head="language_model."),
    Multimodal("mistral3", "Mistral3ForConditionalGeneration", "mistral", text_body="language_model.model.",
               carried=("vision_tower.", "multi_modal_projector."), text_head="language_model.",
               text_aliases=("mistral4",)))}
