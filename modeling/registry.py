"""The model families, by config.json "model_type", and the calls that pick one for a config.

To add a family: a folder `modeling/<name>/` (config, model, pipeline model, TP plan, `family.py`)
and its `ModelFamily` in `FAMILIES` below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeling.family import ModelFamily
from modeling.gpt.family import GPT
from modeling.llama.family import LLAMA
from modeling.pipeline import stage_segments
from modeling.tp_plan import TensorPlan
from paddle_pp.runtime.errors import UserError

if TYPE_CHECKING:
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import Topology

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (LLAMA, GPT)}


class UnknownModelError(UserError, ValueError):
    """A config whose model_type no family is registered for."""


def family(model_type: str) -> ModelFamily:
    if model_type not in FAMILIES:
        raise UnknownModelError(f"model_type {model_type!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(config) -> ModelFamily:
    return family(config.model_type)


def plan_of(config) -> dict[str, TensorPlan]:
    """The TP plan of `config`'s family for this config: every parameter's shape, split and stage."""
    return family_of(config).tensor_plan(config)


def config_from_dict(values: dict):
    """A model config from a Hugging Face-style config dict, chosen by its "model_type"."""
    values = dict(values)
    values.pop("architectures", None)
    return family(values.pop("model_type", None)).config_class(**values)


def validate_layout(config, layout: Layout) -> None:
    """Fail before any process group exists when the config's shapes do not fit together, the model
    does not split over the layout's tp, or its decoder layers over pp x vpp."""
    config.validate()
    family_of(config).check_tensor_parallel(config, layout.tp)
    if layout.pp > 1:
        stage_segments(config.num_hidden_layers, layout.pp, layout.vpp, "decoder")


def build_causal_lm(config, topo: Topology):
    """The model form the layout needs (`*ForCausalLMPipe` when pp > 1, else `*ForCausalLM` with
    TP inside), checked against its family's TP plan."""
    model_family = family_of(config)
    config.tensor_parallel_degree = topo.layout.tp
    config.tensor_parallel_rank = topo.tp_rank
    config.virtual_pp_degree = topo.layout.vpp
    config.sequence_parallel = topo.layout.sequence_parallel
    model = model_family.pipe(config) if topo.layout.pp > 1 else model_family.causal_lm(config)
    model_family.check_built(model, config, topo.layout.pp, topo.pp_rank)
    return model
