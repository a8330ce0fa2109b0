"""The model families, by config.json "model_type", and the calls that pick one for a config.

A new family: a folder `modeling/<name>/` declaring its config and `ModelFamily`, and one line below.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeling.apertus import APERTUS
from modeling.attention_core.ring import Ring, RingCore, context_parallel_refusal
from modeling.blocks.decoder import token_mixers
from modeling.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from modeling.deepseek_v32 import DEEPSEEK_V32, GLM_MOE_DSA
from modeling.ernie4_5 import ERNIE4_5
from modeling.ernie4_5_moe import ERNIE4_5_MOE
from modeling.execution import Execution
from modeling.falcon_h1 import FALCON_H1
from modeling.family import ModelFamily
from modeling.gemma import GEMMA
from modeling.gemma2 import GEMMA2, GEMMA3_TEXT
from modeling.gemma4 import GEMMA4_TEXT
from modeling.glm4_moe import GLM4_MOE
from modeling.glm4_moe_lite import GLM4_MOE_LITE
from modeling.gpt import GPT
from modeling.gpt_oss import GPT_OSS
from modeling.granite import GRANITE
from modeling.granitemoehybrid import GRANITEMOEHYBRID
from modeling.hunyuan_v1_dense import HUNYUAN_V1_DENSE
from modeling.hunyuan_v1_moe import HUNYUAN_V1_MOE
from modeling.hy_v3 import HY_V3
from modeling.kimi_linear import KIMI_LINEAR
from modeling.llama import LLAMA
from modeling.llama4 import LLAMA4_TEXT
from modeling.minimax_m2 import MINIMAX_M2
from modeling.mistral import MISTRAL
from modeling.mistral4 import MISTRAL4
from modeling.mixtral import MIXTRAL
from modeling.mpt import MPT
from modeling.nemotron_h import NEMOTRON_H
from modeling.olmo2 import OLMO2
from modeling.olmo3 import OLMO3
from modeling.olmo_hybrid import OLMO_HYBRID
from modeling.olmoe import OLMOE
from modeling.phi3 import PHI3
from modeling.pipeline import check_stage_split
from modeling.placement import ALWAYS, ModelPlan
from modeling.qwen2 import QWEN2
from modeling.qwen2_moe import QWEN2_MOE
from modeling.qwen3 import QWEN3
from modeling.qwen3_5 import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from modeling.qwen3_moe import QWEN3_MOE
from modeling.qwen3_next import QWEN3_NEXT
from modeling.seed_oss import SEED_OSS
from modeling.smollm3 import SMOLLM3
from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.experts import ExpertGroup

if TYPE_CHECKING:
    from paddle_pp.runtime.layout import Layout
    from paddle_pp.runtime.topology import Topology

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GPT, GEMMA2, GEMMA3_TEXT, PHI3, OLMO2, SMOLLM3, GRANITE, ERNIE4_5, MPT, QWEN2_MOE,
    QWEN3_MOE, MIXTRAL, OLMOE, DEEPSEEK_V3, DEEPSEEK_V2, GLM4_MOE, GPT_OSS, ERNIE4_5_MOE, QWEN3_5_TEXT,
    QWEN3_5_MOE_TEXT, QWEN3_NEXT, OLMO_HYBRID, KIMI_LINEAR, NEMOTRON_H, GRANITEMOEHYBRID, FALCON_H1, OLMO3, SEED_OSS,
    HUNYUAN_V1_DENSE, GLM4_MOE_LITE, LLAMA4_TEXT, MISTRAL4, HUNYUAN_V1_MOE, DEEPSEEK_V32, GLM_MOE_DSA, APERTUS, MINIMAX_M2,
    GEMMA4_TEXT, HY_V3)}
BY_TRANSFORMERS_TYPE = {family.transformers.model_type: family for family in FAMILIES.values() if family.transformers}
ALIASES = {"kimi_k2": DEEPSEEK_V3}  # Kimi-K2's folders are DeepSeek-V3's (transformers' kimi_k25 rewrites it so)


class UnknownModelError(UserError, ValueError):
    """A config whose model_type no family is registered for."""


NOT_YET = {  # families users bring that are refused with why
    "gemma3n": "Gemma 3n's per-layer embeddings and AltUp are not modelled",
    "deepseek_v4": "DeepSeek-V4 is not modelled",
}


def family(model_type: str) -> ModelFamily:
    """The family of a config.json "model_type": ours, PaddleNLP's or transformers' (e.g. "gpt2")."""
    found = FAMILIES.get(model_type) or BY_TRANSFORMERS_TYPE.get(model_type) or ALIASES.get(model_type)
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
    does not split over the layout's tp, or its decoder layers over pp x vpp, or a layer's attention
    is one context parallelism cannot compute."""
    config.validate()
    if layout.cp > 1:
        _check_context_parallel(config, layout)
    family_of(config).check_tensor_parallel(config, layout.tp)
    if layout.pp > 1:
        check_stage_split(config.num_hidden_layers, layout.pp, layout.vpp, layout.dualpipev)
        if layout.vpp > 1 or layout.dualpipev:
            _check_carried_between_chunks(config, layout)
    if getattr(config, "num_experts", 0):
        _check_moe_layout(config, layout)
    elif layout.ep > 1:
        raise LayoutModelError(f"--expert_parallel_degree {layout.ep} with {family_of(config).architecture}, which has "
                               "no experts; drop --expert_parallel_degree")
    if layout.tp > 1 and layout.group_sharded_level:
        plan = plan_of(config)
        partial = ("per-head norms (q/k norms)" if any(row.tp_partial_grad == ALWAYS for row in plan.values()) else
                   f"{config.num_key_value_heads} key/value heads, fewer than the tp ranks (each rank holds the "
                   "projections whole)" if plan.whole_at(layout.tp) else None)
        if partial:
            raise LayoutModelError(
                f"{family_of(config).architecture} has {partial}, whose gradients are summed over tp after "
                f"backward; with --sharding {layout.sharding_stage} that sum and the sharded gradient reduction "
                "both hook the backward pass (untested order); use --sharding stage1 with tp, or tp 1")


def _check_carried_between_chunks(config, layout: Layout) -> None:
    """What layers hand to later ones (Gemma 4's per-layer embeddings and shared keys and values, GLM-5.2's
    shared selections) travels beside the hidden states, a set that changes along the pipeline
    (`blocks/carried.py`); the interleaved schedules send every chunk's output with the one shape they
    cache, which 1F1B does not need."""
    carrying = [index for index in range(config.num_hidden_layers)
                if getattr(config.decoder_layer(index), "carried_in", ())]
    if carrying:
        schedule = "--pipeline_schedule DualPipeV" if layout.dualpipev else f"--virtual_pp_degree {layout.vpp}"
        raise LayoutModelError(
            f"{schedule} with {family_of(config).architecture}: what its layers hand to later layers (per-layer "
            "embeddings, shared keys and values or selections) travels between pipeline stages (into decoder layers "
            f"{carrying[0]}..{carrying[-1]}), a set that changes from stage to stage, and the interleaved schedules "
            f"send one shape; use 1F1B (drop {schedule.split()[0]})")


def _check_context_parallel(config, layout: Layout) -> None:
    """Ring attention computes scale, soft-cap, sinks and windows; ALiBi is refused by name (never
    trained without its biases). Recurrent layers carry their state and conv window between the parts.
    Sparse attention is refused by name: its indexer ranks every earlier key of a query, which under cp
    other ranks hold (gathering the index keys over the ring, Megatron's balanced indexer, is not built)."""
    for index in range(config.num_hidden_layers):
        if any(getattr(mixer, "indexer", None) is not None for mixer in token_mixers(config.decoder_layer(index))):
            raise LayoutModelError(
                f"--context_parallel_degree {layout.cp} with {family_of(config).architecture}: decoder layer {index}'s "
                "sparse attention selects each query's keys among all earlier keys, which under cp other ranks hold "
                "(not implemented). Use --context_parallel_degree 1")
        # a recurrent mixer's state and conv window cross the parts (modeling/recurrent_cp.py)
        problem = next(filter(None, (context_parallel_refusal(mixer.spec)
                                     for mixer in token_mixers(config.decoder_layer(index)) if not mixer.recurrent)), None)
        if problem:
            raise LayoutModelError(
                f"--context_parallel_degree {layout.cp} with {family_of(config).architecture}: decoder layer {index} "
                f"has {problem}, which ring attention does not compute (its blocks carry no distances across "
                "ranks). Use --context_parallel_degree 1")


def check_context_parts(config, layout: Layout, seq_len: int) -> None:
    """Under context parallelism a recurrent layer's conv takes its window's first kernel - 1 inputs
    from the part before (`recurrent_cp.conv_halos`): each of the 2 x cp parts of a sequence must
    hold that many tokens."""
    if layout.cp == 1:
        return
    part = seq_len // (2 * layout.cp)
    for index in range(config.num_hidden_layers):
        mixer = next((mixer for mixer in token_mixers(config.decoder_layer(index)) if mixer.recurrent), None)
        if mixer is not None and mixer.conv_kernel - 1 > part:
            raise LayoutModelError(
                f"--context_parallel_degree {layout.cp} cuts --max_seq_length {seq_len} into parts of {part} tokens, "
                f"and decoder layer {index}'s conv (kernel {mixer.conv_kernel}) takes {mixer.conv_kernel - 1} from "
                f"the part before; use --max_seq_length of at least {2 * layout.cp * (mixer.conv_kernel - 1)} or a "
                "smaller --context_parallel_degree")


def _check_moe_layout(config, layout: Layout) -> None:
    """The axes a mixture-of-experts model does not train under yet, refused by name."""
    name = family_of(config).architecture
    if config.num_experts % layout.ep:
        raise LayoutModelError(f"{name} has {config.num_experts} experts per layer, which do not split over "
                               f"--expert_parallel_degree {layout.ep}; choose an ep that divides {config.num_experts}")


def execution_for(layout: Layout, tp_rank: int, choices: Execution = Execution(), ring: Ring | None = None,
                  experts: ExpertGroup | None = None, tp_group: Any = None) -> Execution:
    """The run's `Execution` on a rank of `layout`: `choices` (attention core, recompute, kernels)
    with the layout's parallel degrees and this rank's place in them; under context parallelism its
    attention goes around `ring` with the chosen core's kernel (`plan_run` refused the dense core
    there: it keeps no log-sum-exp)."""
    run = replace(choices, tp=layout.tp, tp_rank=tp_rank, sequence_parallel=layout.sequence_parallel,
                  vpp=layout.vpp, dualpipev=layout.dualpipev, experts=experts, tp_group=tp_group)
    if ring is None:
        return run
    return replace(run, ring=ring, attention=RingCore(ring=ring, inner=run.attention))


def core_notes(config, run: Execution) -> list[str]:
    """The layers the run's attention core cannot compute (flash: a soft-cap, ALiBi, sinks, v unlike
    q/k), which take the blockwise core instead, by reason, and the sparse-attention layers, which take
    the selected-key core: what the run says at its start."""
    by_reason: dict[str, list[int]] = {}
    indexed: list[int] = []
    for index in range(config.num_hidden_layers):
        for attention in (mixer for mixer in token_mixers(config.decoder_layer(index)) if not mixer.recurrent):
            if getattr(attention, "sparse", False):  # its indexer's selection, or an earlier layer's (GLM-5.2)
                indexed.append(index)
                continue
            reason = run.attention.refusal(attention.spec, attention.sinks, attention.local_heads(run))
            if reason:
                by_reason.setdefault(reason, []).append(index)
    notes = [f"attention: decoder layers {', '.join(map(str, layers))} take the blockwise core (the {run.attention.name} "
             f"core does not compute {reason})" for reason, layers in by_reason.items()]
    if indexed:
        notes.append(f"attention: decoder layers {', '.join(map(str, indexed))} attend to the keys their indexer (or "
                     "an earlier layer's) selects with the selected-key core (sparse attention; the "
                     f"{run.attention.name} core only in a dense warm-up)")
    return notes


def build_causal_lm(config, topo: Topology, choices: Execution = Execution()):
    """The model form the layout needs (`*ForCausalLMPipe` when pp > 1, else `*ForCausalLM` with
    TP inside) for the run's `choices`, checked against its family's declaration."""
    model_family = family_of(config)
    run = execution_for(topo.layout, topo.tp_rank, choices, topo.ring, topo.experts,
                        topo.tp_group if topo.layout.tp > 1 else None)
    model = model_family.pipe(config, run) if topo.layout.pp > 1 else model_family.causal_lm(config, run)
    model_family.check_built(model, config, run, topo.layout.pp, topo.pp_rank)
    return model
