"""A model family, declared once: its config class, where its pieces sit (`Skeleton`), how it maps
to transformers, and whether PaddleNLP has it. Everything else is derived here: the single-card/TP
model and the pipeline model (generated classes named `<Arch>` and `<Arch>Pipe`), the TP plan, the
tp divisibility checks, the activation model, the check that a built model agrees with its plan.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cached_property

from modeling.blocks.decoder import LayerActivations
from modeling.causal_lm import CausalLM, Skeleton
from modeling.execution import Execution
from modeling.lora import LoRA, with_adapters
from modeling.pipeline import CausalLMPipe
from modeling.placement import ModelPlan, check_divisible, check_shared
from modeling.transformers_adapter import TransformersAdapter


class PlanMismatchError(RuntimeError):
    """A built model whose parameters disagree with its family's TP plan (a bug in the family)."""


@dataclass(frozen=True)
class ModelFamily:
    config_class: type  # its `model_type` is config.json's
    architecture: str  # config.json "architectures"; PaddleNLP's class of this name loads our folders when `paddlenlp`
    skeleton: Skeleton
    transformers: TransformersAdapter | None = None
    paddlenlp: bool = False  # PaddleNLP 3.0.0b4 has this family under the same names
    paddlenlp_fused: frozenset[str] = frozenset()  # its fuse_attention_qkv / fuse_attention_ffn, if it has them

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @cached_property
    def causal_lm(self) -> type:
        """`<Arch>`: single card, or TP with fleet's parallel layers under an `Execution` with tp > 1."""
        return self._generated(self.architecture, CausalLM)

    @cached_property
    def pipe(self) -> type:
        """`<Arch>Pipe`: PaddleNLP's PipelinePretrainedModel + fleet's PipelineLayer, single-card prefixes."""
        return self._generated(f"{self.architecture}Pipe", CausalLMPipe)

    def _generated(self, name: str, base: type) -> type:
        namespace = {"family": self, "config_class": self.config_class,
                     "base_model_prefix": self.skeleton.base_prefix, "__module__": self.config_class.__module__}
        return types.new_class(name, (base,), {}, lambda ns: ns.update(namespace))

    def tensor_plan(self, config) -> ModelPlan:
        """Every tensor the config's model holds: the skeleton's, and the LoRA adapters it declares (`modeling.lora`)."""
        return ModelPlan(self.model_type, self.architecture, config.num_hidden_layers,
                         with_adapters(self.skeleton.tensors(config), LoRA.of(config)), self.skeleton.tied_names(config))

    def check_tensor_parallel(self, config, tp: int) -> None:
        """Fail before any weight is built when the vocabulary or a unit TP splits (heads, MLP width)
        does not divide by `tp`, or key/value heads neither divide by `tp` nor divide it."""
        units: dict[str, int] = {}
        shared: dict[str, int] = {}
        for _, part, _ in self.skeleton.parts(config):
            units |= part.tp_units()
            shared |= part.tp_shared_units()
        check_divisible(self.architecture, units, tp)
        check_shared(self.architecture, shared, tp)

    def layer_saved_bytes(self, config, run: Execution, batch: int, seq_len: int, dtype_bytes: int = 4,
                          index: int | None = None) -> dict[str, int]:
        """What decoder layer `index` (None: the one keeping most) keeps for backward on a rank with
        nothing recomputed, by sublayer (those that keep something)."""
        layer = config.decoder_layer(index) if index is not None else \
            self.heaviest_layer(config, run, batch, seq_len, dtype_bytes)
        return {name: size for name, size in layer.saved_bytes(run, batch, seq_len, dtype_bytes).items() if size}

    def layer_activations(self, config, run: Execution, batch: int, seq_len: int, dtype_bytes: int = 4,
                          index: int | None = None) -> LayerActivations:
        """Decoder layer `index`'s activations (None: the layer keeping most) on a rank under the run's
        recompute (the planner's model)."""
        layer = config.decoder_layer(index) if index is not None else \
            self.heaviest_layer(config, run, batch, seq_len, dtype_bytes)
        return layer.activations(run, batch, seq_len, dtype_bytes)

    def heaviest_layer(self, config, run: Execution, batch: int, seq_len: int, dtype_bytes: int):
        """The decoder layer declaration that keeps most for backward (the first, where all are alike)."""
        return max((config.decoder_layer(i) for i in range(config.num_hidden_layers)),
                   key=lambda layer: sum(layer.saved_bytes(run, batch, seq_len, dtype_bytes).values()))

    def check_built(self, model, config, run: Execution, pp: int, stage: int) -> None:
        """The built model holds exactly the plan's tensors for its stage, in the plan's per-rank
        shapes. Run on every rank of every job, so a declaration that drifts from the model code
        fails at start-up instead of saving a checkpoint that another layout reads wrong."""
        plan = self.tensor_plan(config)
        mesh = plan.mesh(pp, run.vpp, run.experts.degree if run.experts else 1, run.tp, run.dualpipev)
        expected = set(plan.held_at(stage, run.experts.rank if run.experts else 0, mesh))
        held = {name: tuple(param.shape) for name, param in model.state_dict().items()}
        planned = {name: plan[name].placement.local_shape(plan[name].shape, mesh) for name in held if name in plan}
        problems = [f"{name}: held but not planned for stage {stage}" for name in sorted(set(held) - expected)]
        problems += [f"{name}: planned for stage {stage} but not held" for name in sorted(expected - set(held))]
        problems += [f"{name}: shape {list(held[name])}, the plan gives {list(shape)} at tp {run.tp}"
                     for name, shape in sorted(planned.items()) if held[name] != shape]
        if problems:
            raise PlanMismatchError(f"{self.architecture} disagrees with its declaration: " + "; ".join(problems[:5]))
