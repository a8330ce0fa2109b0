"""The parts of a multimodal folder that do not train (`modeling/multimodal.py`: a vision tower),
carried through a run bit for bit.

A run from such a folder writes them once into its output folder (`CARRIED_DIR`: `CARRIED_TENSORS`: every carried
tensor as the folder stored it, dtype and bytes; `CARRIED_CONFIG`: the folder's config.json as it
came), and every checkpoint copies both beside its own files, so a resume, under any layout, carries
them on. A checkpoint saved in transformers' layout lists the carried tensors in its index and writes
the multimodal config.json (`their_config`), as does an export: what is saved is the multimodal folder
transformers loads, its language model the trained one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from checkpoint.durable import write_json_durably
from checkpoint.format import CheckpointError
from checkpoint.shards import ShardReader, TensorSpec, write_shard
from modeling.multimodal import MULTIMODAL, Multimodal

CARRIED_TENSORS, CARRIED_CONFIG = "carried.safetensors", "carried.json"
CARRIED_DIR = ".carried"  # where a run keeps them in its --output_dir, for its saves to copy
TEXT_CONFIG = "text_config"


@dataclass(frozen=True)
class Carried:
    """A multimodal folder's `config` (its config.json as it came) and the carried tensors' `names`,
    each read as stored (`read`: dtype and bits)."""

    config: dict
    names: tuple[str, ...]
    read: Callable[[str], np.ndarray]

    @property
    def kind(self) -> Multimodal:
        return MULTIMODAL[self.config["model_type"]]

    def write(self, target: Path) -> tuple[Path, Path]:
        """Both files into `target` (made if missing); their paths."""
        target.mkdir(parents=True, exist_ok=True)
        arrays = [self.read(name) for name in self.names]
        write_shard(target / CARRIED_TENSORS, [TensorSpec(name, array.dtype, tuple(array.shape))
                                               for name, array in zip(self.names, arrays)], arrays, {"format": "pt"})
        write_json_durably(target / CARRIED_CONFIG, self.config)
        return target / CARRIED_TENSORS, target / CARRIED_CONFIG

    def their_config(self, text: dict) -> dict:
        """The multimodal config.json around the language model's `text` config (transformers' form)."""
        inner = {key: value for key, value in text.items() if key not in ("architectures", "torch_dtype")}
        inner["model_type"] = self.config.get(TEXT_CONFIG, {}).get("model_type", self.kind.text_model_type)
        outer = {key: value for key, value in self.config.items() if key != "torch_dtype"}
        return {**outer, TEXT_CONFIG: inner, "tie_word_embeddings": text.get("tie_word_embeddings", False),
                "dtype": text.get("torch_dtype", self.config.get("dtype"))}


def carried_in(folder: Path) -> Carried | None:
    """The carried parts a checkpoint (or a run's output folder) holds, or None."""
    folder = Path(folder)
    if not (folder / CARRIED_CONFIG).is_file():
        return None
    if not (folder / CARRIED_TENSORS).is_file():
        raise CheckpointError(f"{folder / CARRIED_TENSORS} is missing beside {CARRIED_CONFIG}: the multimodal parts "
                              "this checkpoint carries are lost; restore the file or resume from an older checkpoint")
    reader = ShardReader(folder / CARRIED_TENSORS)
    return Carried(json.loads((folder / CARRIED_CONFIG).read_text()), tuple(sorted(reader.names)), reader.read_stored)


def text_config(raw: dict, folder: Path) -> dict:
    """A multimodal config.json's language model config, checked: of a text family the kind names (the
    family its model_type is, an alias read as its family), tied as the folder says."""
    from modeling.registry import family

    kind = MULTIMODAL[raw["model_type"]]
    text = dict(raw.get(TEXT_CONFIG) or {})
    model_type = text.get("model_type", kind.text_model_type)
    if model_type not in (kind.text_model_type, *kind.text_aliases):
        raise CheckpointError(f"--model_name_or_path {folder}: a {kind.model_type} folder's text_config is "
                              f"{model_type!r}, where transformers builds one of "
                              f"{[kind.text_model_type, *kind.text_aliases]}")
    outer, inner = raw.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if outer is not None and inner is not None and outer != inner:
        raise CheckpointError(f"--model_name_or_path {folder}: config.json says tie_word_embeddings={outer} and its "
                              f"text_config {inner}; make them agree")
    tied = next((value for value in (inner, outer) if value is not None), False)
    return {**text, "model_type": family(model_type).model_type, "tie_word_embeddings": tied}
