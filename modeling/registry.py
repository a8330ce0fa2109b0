"""The model families, by config.json "model_type", and the calls that pick one for a config.

A new family: a folder `modeling/<name>/` declaring its config and `ModelFamily`, and one line below.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from modeling.attention_core.blockwise import DEFAULT_BLOCK
from modeling.context_parallel import Ring, RingCore
from modeling.execution import Execution
from modeling.family import ModelFamily
from modeling.gemma import GEMMA
from modeling.gpt import GPT
from modeling.llama import LLAMA
from modeling.mistral import MISTRAL
from modeling.mixtral import MIXTRAL
from modeling.olmoe import OLMOE
from modeling.pipeline import stage_segments
from modeling.qwen2 import QWEN2
from modeling.qwen2_moe import QWEN2_MOE
from modeling.qwen3 import QWEN3
from modeling.qwen3_moe import QWEN3_MOE
from modeling.tp_plan import ALWAYS, ModelPlan
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.experts import ExpertGroup

if TYPE_CHECKING:
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import Topology

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GPT, QWEN2_MOE, QWEN3_MOE,
                                                                        MIXTRAL, OLMOE)}
BY_TRANSFORMERS_TYPE = {family.transformers.model_type: family for family in FAMILIES.values() if family.transformers}


class UnknownModelError(UserError, ValueError):
    """A config whose model_type no family is registered for."""


_DEEPSEEK = ("DeepSeek's MLA attention and group-limited sigmoid routing with a correction bias are not modelled "
             "yet")
NOT_YET = {"deepseek_v2": _DEEPSEEK, "deepseek_v3": _DEEPSEEK}  # families users bring that are refused with why


def family(model_type: str) -> ModelFamily:
    """The family of a config.json "model_type": ours, PaddleNLP's or transformers' (e.g. "gpt2")."""
    found = FAMILIES.get(model_type) or BY_TRANSFORMERS_TYPE.get(model_type)
    if found is None:
        why = f"; {NOT_YET[model_type]}" if model_type in NOT_YET else ""
        raise UnknownModelError(f"model_type {model_type!r} is not one of {sorted(FAMILIES)} "
                                f"(transformers: {sorted(BY_TRANSFORMERS_TYPE)}){why}")
    return found


def family_of(config) -> ModelFamily:
    return family(config.model_type)


def plan_of(config) -> ModelPlan:
    """The TP plan of `config`'s family for this config: every parameter's shape, split and stage."""
    return family_of(config).tensor_plan(config)


def config_from_dict(values: dict):
    """A model config from our config.json dict, chosen by its "model_type"."""
    values = dict(values)
    values.pop("architectures", None)
    return family(values.pop("model_type", None)).config_class(**values)


def load_config(folder: Path):
    """The model config of a folder's config.json (a checkpoint, a weights-only export)."""
    return config_from_dict(json.loads((Path(folder) / "config.json").read_text()))


def plan_of_folder(folder: Path) -> ModelPlan:
    """The plan of the model a folder's config.json describes."""
    return plan_of(load_config(folder))


class LayoutModelError(UserError, ValueError):
    """A model and a layout that do not go together."""


def validate_layout(config, layout: Layout) -> None:
    """Fail before any process group exists when the config's shapes do not fit together, the model
    does not split over the layout's tp, or its decoder layers over pp x vpp."""
    config.validate()
    family_of(config).check_tensor_parallel(config, layout.tp)
    if layout.pp > 1:
        stage_segments(config.num_hidden_layers, layout.pp, layout.vpp, "decoder")
    if getattr(config, "num_experts", 0):
        _check_moe_layout(config, layout)
    elif layout.ep > 1:
        raise LayoutModelError(f"--expert_parallel_degree {layout.ep} with {family_of(config).architecture}, which has "
                               "no experts; drop --expert_parallel_degree")
    if layout.tp > 1 and layout.group_sharded_level and any(
            row.tp_partial_grad == ALWAYS for row in plan_of(config).values()):
        raise LayoutModelError(
            f"{family_of(config).architecture} has per-head norms (q/k norms) whose gradients are summed over "
            f"tp after backward; with --sharding {layout.sharding_stage} that sum and the sharded gradient "
            "reduction both hook the backward pass (untested order); use --sharding stage1 with tp, or tp 1")


def _check_moe_layout(config, layout: Layout) -> None:
    """The axes a mixture-of-experts model does not train under yet, refused by name."""
    name = family_of(config).architecture
    if config.num_experts % layout.ep:
        raise LayoutModelError(f"{name} has {config.num_experts} experts per layer, which do not split over "
                               f"--expert_parallel_degree {layout.ep}; choose an ep that divides {config.num_experts}")
    if layout.cp > 1:
        raise LayoutModelError(f"{name} with --context_parallel_degree {layout.cp}: the aux loss's statistic is not "
                               "yet pooled over the cp ranks of a sequence (not implemented); use "
                               "--context_parallel_degree 1")


def execution_for(layout: Layout, tp_rank: int, choices: Execution = Execution(), ring: Ring | None = None,
                  experts: ExpertGroup | None = None) -> Execution:
    """The run's `Execution` on a rank of `layout`: `choices` (attention core, recompute, kernels)
    with the layout's parallel degrees and this rank's place in them; under context parallelism its
    attention goes around `ring` with the chosen core's kernel (the dense core cannot: it has no
    log-sum-exp)."""
    run = replace(choices, tp=layout.tp, tp_rank=tp_rank, sequence_parallel=layout.sequence_parallel,
                  vpp=layout.vpp, experts=experts)
    if ring is None:
        return run
    if run.attention.name == "dense":
        raise LayoutModelError("--context_parallel_degree needs a core that merges partial attention by its "
                               "log-sum-exp; the dense core (--no-use_flash_attention) has none. Drop "
                               "--no-use_flash_attention (context parallelism then runs the blockwise kernel)")
    block = getattr(run.attention, "block", DEFAULT_BLOCK)
    kernel = "flash" if run.attention.name == "flash" else "blockwise"
    return replace(run, ring=ring, attention=RingCore(ring=ring, block=block, kernel=kernel))


def build_causal_lm(config, topo: Topology, choices: Execution = Execution()):
    """The model form the layout needs (`*ForCausalLMPipe` when pp > 1, else `*ForCausalLM` with
    TP inside) for the run's `choices`, checked against its family's declaration."""
    model_family = family_of(config)
    run = execution_for(topo.layout, topo.tp_rank, choices, topo.ring, topo.experts)
    model = model_family.pipe(config, run) if topo.layout.pp > 1 else model_family.causal_lm(config, run)
    model_family.check_built(model, config, run, topo.layout.pp, topo.pp_rank)
    return model
