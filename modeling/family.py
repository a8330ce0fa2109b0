"""What the rest of the code base may know about a model family: one `ModelFamily` object each.

The checkpoint, the planner and the tools ask a family for its TP plan, its names and its classes
instead of matching parameter names themselves; a new family is one folder with a `family.py`
and one line in `modeling/registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from modeling.tp_plan import Plan, TensorPlan, local_shape, stages_holding


class PlanMismatchError(RuntimeError):
    """A built model whose parameters disagree with its family's TP plan (a bug in the family)."""


@dataclass(frozen=True)
class TransformersNames:
    """How a family's single-card names and config map to Hugging Face transformers' (whose linear
    weights are stored [out, in], the transpose of Paddle's: the plan marks them `linear`)."""

    to_hf: Callable[[str], str]
    from_hf: Callable[[str], str]
    config_keys: tuple[str, ...]  # config.json fields both sides share
    fixed_config: dict = field(default_factory=dict)  # transformers-only fields with this family's values


@dataclass(frozen=True)
class ModelFamily:
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures" entry; PaddleNLP's class of the same name loads our folders
    config_class: type
    causal_lm: type  # single card, or TP with fleet's parallel layers when config.tensor_parallel_degree > 1
    pipe: type  # PipelinePretrainedModel + PipelineLayer, registered under single-card prefixes
    tensor_plan: Callable[..., dict[str, TensorPlan]]
    check_tensor_parallel: Callable[..., None]  # (config, tp): raises TPPlanError naming the field
    tied_groups: Callable[..., list[list[str]]]  # names that denote one tensor, the stored one first
    # (config, batch, seq_len, tp, sequence_parallel, dtype_bytes) -> bytes one decoder layer saves, by sublayer
    layer_activation_bytes: Callable[..., dict[str, int]]
    transformers: TransformersNames | None = None

    def stage_names(self, plan: Plan, num_layers: int, pp: int, vpp: int, stage: int) -> set[str]:
        """Single-card names the pipeline stage `stage` holds."""
        return {name for name, row in plan.items() if stage in stages_holding(row, num_layers, pp, vpp)}

    def check_built(self, model, config, pp: int, stage: int) -> None:
        """The built model holds exactly the plan's tensors for its stage, in the plan's per-rank
        shapes. Run on every rank of every job, so a plan that drifts from the model code fails at
        start-up instead of saving a checkpoint that another layout reads wrong."""
        plan, tp = self.tensor_plan(config), max(config.tensor_parallel_degree, 1)
        expected = self.stage_names(plan, config.num_hidden_layers, pp, config.virtual_pp_degree, stage)
        held = {name: tuple(param.shape) for name, param in model.state_dict().items()}
        problems = [f"{name}: held but not planned for stage {stage}" for name in sorted(set(held) - expected)]
        problems += [f"{name}: planned for stage {stage} but not held" for name in sorted(expected - set(held))]
        problems += [f"{name}: shape {list(shape)}, the plan gives {list(local_shape(plan[name].shape, plan[name].tp_axis, tp))} at tp {tp}"
                     for name, shape in sorted(held.items())
                     if name in plan and shape != local_shape(plan[name].shape, plan[name].tp_axis, tp)]
        if problems:
            raise PlanMismatchError(f"{self.architecture} disagrees with modeling/{self.model_type}/tp_plan.py: "
                                    + "; ".join(problems[:5]))
