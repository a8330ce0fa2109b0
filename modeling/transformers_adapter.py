"""How a family maps to Hugging Face transformers: where each of our tensors is stored in a
transformers folder (name, transpose, a slice of a fused tensor), and its config.json both ways.

Reading a config cannot be silently wrong: every field is modelled (taken into our config, under
our name), accepted only with the values we compute the same way (`fixed`, `accepted`), harmless
(`config_fields.HARMLESS`: it does not change the forward), or refused by name. Transformers 5's
spelling (`rope_parameters`, `dtype`) is read as transformers 4.x's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from modeling.config_fields import HARMLESS, as_transformers4
from modeling.placement import TensorPlan

RUN_FIELDS = ("self", "kwargs")  # a config class's __init__ arguments that are no model field


class ConfigFieldError(ValueError):
    """A config.json field that would change the model in a way paddle-pp does not compute."""


@dataclass(frozen=True)
class Stored:
    """Where one of our tensors is in a model folder (transformers', PaddleNLP's): under `name`,
    transposed or not, and when their tensor fuses several of ours, along `axis` either our slice
    `part` of `parts` equal ones, or with `interleave` = (group width, offset, width) the `width`
    entries at `offset` of every group of `group width` entries (PaddleNLP's fused qkv); `sizes` gives
    the widths of unequal parts (Phi-3's fused q, k and v under GQA). With
    `stack` = (index, count) the stored tensor stacks `count` such tensors along a new first axis
    and ours is in entry `index` (transformers 5's fused experts); the rest applies to that entry."""

    name: str
    transposed: bool = False
    axis: int | None = None
    part: int = 0
    parts: int = 1
    interleave: tuple[int, int, int] | None = None
    stack: tuple[int, int] | None = None
    sizes: tuple[int, ...] | None = None  # parts of unequal widths along `axis` (Phi-3's q, k, v), in order

    @property
    def fused(self) -> bool:
        return self.parts > 1 or self.interleave is not None

    def span(self) -> tuple[int, int]:
        """(start, width) of our part along `axis` of the stored tensor."""
        if self.sizes is None:
            raise ValueError(f"{self.name}: parts of equal widths have no sizes")
        return sum(self.sizes[:self.part]), self.sizes[self.part]

    def select(self, stored: np.ndarray) -> np.ndarray:
        """Our entries of an interleaved stored tensor, or of a piece of it made of whole groups."""
        group, offset, width = self.interleave
        axis = self.axis
        grouped = stored.reshape(stored.shape[:axis] + (-1, group) + stored.shape[axis + 1:])
        ours = np.take(grouped, np.arange(offset, offset + width), axis=axis + 1)
        return ours.reshape(ours.shape[:axis] + (-1,) + ours.shape[axis + 2:])


def join(members: list[tuple[Stored, np.ndarray]]) -> np.ndarray:
    """The stored tensor made of our `members` (each array in the stored orientation, with where it sits):
    a stack's entries each joined from its members, then stacked in order."""
    if members[0][0].stack is not None:
        entries: dict[int, list[tuple[Stored, np.ndarray]]] = {}
        for stored, array in members:
            entries.setdefault(stored.stack[0], []).append((replace(stored, stack=None), array))
        if sorted(entries) != list(range(members[0][0].stack[1])):
            raise ValueError(f"{members[0][0].name}: the entries given do not fill its stack")
        return np.stack([join(entries[index]) for index in sorted(entries)])
    first = members[0][0]
    if len(members) == 1 and not first.fused:
        return members[0][1]
    if first.interleave is None:
        return np.concatenate([array for _, array in sorted(members, key=lambda m: m[0].part)], axis=first.axis)
    axis = first.axis
    grouped = [array.reshape(array.shape[:axis] + (-1, stored.interleave[2]) + array.shape[axis + 1:])
               for stored, array in sorted(members, key=lambda m: m[0].interleave[1])]
    whole = np.concatenate(grouped, axis=axis + 1)
    if whole.shape[axis + 1] != first.interleave[0]:
        raise ValueError(f"{first.name}: the parts given do not fill its groups of {first.interleave[0]}")
    return whole.reshape(whole.shape[:axis] + (-1,) + whole.shape[axis + 2:])


@dataclass(frozen=True)
class TransformersAdapter:
    model_type: str  # transformers' model_type
    architecture: str  # transformers' class
    locate: Callable[[str, TensorPlan], Stored]  # (our name, its placement) -> where transformers stores it
    renamed: dict[str, str] = field(default_factory=dict)  # their config field -> ours
    aliases: dict[str, str] = field(default_factory=dict)  # another spelling of one of ours, read but never written
    fixed: dict[str, Any] = field(default_factory=dict)  # fields we do not model: the only value read, and written
    accepted: dict[str, Callable[[Any, dict], bool]] = field(default_factory=dict)  # read, checked, dropped
    buffers: tuple[str, ...] = ()  # name suffixes of non-parameter tensors some folders store (recomputed here)
    fuse: Callable[[Stored, Any], Stored] | None = None  # (where `locate` says, our config) -> where fused tensors put it
    recut: tuple[tuple[str, ...], ...] = ()  # stored-name suffixes of groups some folders cut elsewhere (interop.recut)
    layers_past_last: str | None = None  # what the decoder layers some folders store past the config's last are
    unread: tuple[str, ...] = ()  # name prefixes of tensors its folders carry that the model leaves unread, as
    # transformers does (Qwen3.5's and Qwen3-Next's multi-token prediction layer, `mtp.`)
    copies: Callable[[Any], dict[str, str]] | None = None  # (our config) -> {stored name: our tensor it copies}

    def stored_copies(self, config) -> dict[str, str]:
        """Tensors a folder of `config` stores as copies of ours (multi-token prediction layers' copies
        of the embedding and head): written on export, never read."""
        return self.copies(config) if self.copies else {}

    def stored(self, name: str, row: TensorPlan, config) -> Stored:
        """Where transformers stores our tensor `name` of a model of `config` (a fused tensor's part
        depends on the config's widths: Phi-3's q, k and v under GQA)."""
        stored = self.locate(name, row)
        return stored if self.fuse is None else self.fuse(stored, config)

    def our_config(self, raw: dict, config_class: type) -> dict:
        """Our config fields from a transformers (or PaddleNLP) config.json, or ConfigFieldError
        naming every field that would change the model and is not modelled."""
        values = as_transformers4(raw)
        modelled = model_fields(config_class)
        ours, problems = {}, []
        for key, value in values.items():
            name = self.renamed.get(key) or self.aliases.get(key, key)
            if name in modelled:
                ours[name] = value
            elif key in self.fixed:
                if value != self.fixed[key]:
                    problems.append(f"{key}={value!r} (only {self.fixed[key]!r} is modelled)")
            elif key in self.accepted:
                if not self.accepted[key](value, values):
                    problems.append(f"{key}={value!r} (changes the model; not modelled)")
            elif key in HARMLESS:
                if not HARMLESS[key](value, values):
                    problems.append(f"{key}={value!r} (changes the model; not modelled)")
            else:
                problems.append(f"{key}={value!r} (a field paddle-pp does not know: it may change the model)")
        if problems:
            raise ConfigFieldError("; ".join(problems))
        return ours

    def their_config(self, config, dtype: str) -> dict:
        """transformers' config.json for `config` (transformers 4.x spelling, which 5 reads too, or 5's
        where 4.x has no spelling for a field: `config.transformers_spelling`)."""
        theirs = {ours: name for name, ours in self.renamed.items()}
        values = {theirs.get(name, name): getattr(config, name) for name in model_fields(type(config))
                  if name not in config.derived_fields}
        return {"architectures": [self.architecture], "model_type": self.model_type, "torch_dtype": dtype,
                **self.fixed, **config.transformers_spelling(values)}


def model_fields(config_class: type) -> tuple[str, ...]:
    """The config fields that describe the model: the arguments of the config class's `__init__`
    and its bases' (a family's config passes the common ones on as keyword arguments), less run
    settings; PaddleNLP's PretrainedConfig is where model configs end."""
    from paddlenlp.transformers.configuration_utils import PretrainedConfig

    names: dict[str, None] = {}
    for cls in config_class.__mro__:
        if cls is PretrainedConfig:
            break
        if "__init__" in cls.__dict__:
            names |= dict.fromkeys(inspect.signature(cls.__init__).parameters)
    return tuple(name for name in names if name not in RUN_FIELDS)
