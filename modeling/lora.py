"""LoRA: a low-rank update beside a model's projections, y = x W + (x A) B x scale, W frozen.

The run's `LoRA` lives in the model config (`config.lora`, kept in config.json), so the plan of a
LoRA model declares its adapters (`with_adapters`): every projection a target names (a module name
as PEFT's `target_modules`, a regular expression over the whole path as PaddleFormers', or
"all-linear": every projection but routers and the head) gains `<path>.lora_A` [in, r] and
`<path>.lora_B` [r, out], Paddle's [in, out] layout as the weight. Checkpoints save, load, reshard
and verify them as any tensor, by that plan.

Under tensor parallelism each adapter follows its projection (placements from the weight's):
- column-parallel (output split): A whole on every rank, B split as the weight. x A is the same on
  every rank; it passes an identity whose backward sums over tp, so A's gradient and the input's
  are whole (under sequence parallelism the block already gathered x and reduce-scatters its
  gradient: A's gradient is then partial, summed at the update as a norm's);
- row-parallel (input split): A split as the weight, B whole; x A is summed over tp before B (under
  sequence parallelism reduce-scattered along the sequence as the projection's output is, and B's
  gradient, of this rank's positions, partial);
- a key/value projection every rank holds whole (fewer heads than ranks): both whole, each rank
  using its heads' share, both gradients partial over heads;
- a projection held whole (latent attention's down-projections): as its weight.
The adapter runs as a forward post-hook on the projection's own layer, so the layer, its
parameters' names and its tp collectives stay as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.distributed.fleet.layers.mpu import mp_layers, mp_ops
from paddle.distributed.fleet.utils import sequence_parallel_utils as sp_utils

from modeling import tp_layers
from modeling.execution import Execution
from modeling.placement import COLUMN, KAIMING_UNIFORM, REPLICATED, ROW, UNDER_SEQUENCE_PARALLEL, ZEROS, TensorPlan
from modeling.tp_gradients import PARTIAL_OVER_HEADS
from paddle_pp.runtime.experts import EXPERT_MARK, is_expert

LORA_A, LORA_B = "lora_A", "lora_B"
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoRA:
    """The adapters of a run: rank, alpha (scale alpha / rank, or alpha / sqrt(rank) with rsLoRA), the targeted
    projections, dropout on the adapter's input, and LoRA+'s learning-rate ratio of B to A."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0
    rslora: bool = False
    plus_scale: float = 1.0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets_path(self, path: str) -> bool:
        """Whether the projection at single-card `path` (e.g. model.layers.0.self_attn.q_proj) is adapted."""
        name = path.rsplit(".", 1)[-1]
        return any(target in (ALL_LINEAR, name) or re.fullmatch(target, path) for target in self.targets)

    def to_dict(self) -> dict:
        return asdict(self) | {"targets": list(self.targets)}

    @classmethod
    def of(cls, config) -> LoRA | None:
        """The config's adapters (config.json's "lora"), or None."""
        values = getattr(config, "lora", None)
        return None if not values else cls(**(values | {"targets": tuple(values["targets"])}))


def is_adapter(name: str) -> bool:
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


def with_adapters(tensors: dict[str, TensorPlan], lora: LoRA | None) -> dict[str, TensorPlan]:
    """`tensors` with each targeted projection's A and B after its weight."""
    if lora is None:
        return tensors
    adapted = {}
    for name, row in tensors.items():
        adapted[name] = row
        path = name.removesuffix(".weight")
        if row.adaptable and name.endswith(".weight") and lora.targets_path(path):
            adapted[f"{path}.{LORA_A}"], adapted[f"{path}.{LORA_B}"] = adapter_plans(row, lora.rank)
    return adapted


def adapter_plans(weight: TensorPlan, rank: int) -> tuple[TensorPlan, TensorPlan]:
    """(A, B) of a projection whose weight is `weight` ([in, out]), placed as the module docstring says."""
    fan_in, fan_out = weight.shape
    whole = replace(weight.placement, tp=REPLICATED, tp_units=None)
    if weight.placement.tp == COLUMN:
        a_place, b_place, a_partial, b_partial = whole, weight.placement, UNDER_SEQUENCE_PARALLEL, None
    elif weight.placement.tp == ROW:
        a_place, b_place, a_partial, b_partial = weight.placement, whole, None, UNDER_SEQUENCE_PARALLEL
    else:
        a_place = b_place = weight.placement
        a_partial = b_partial = weight.tp_partial_grad
    return (TensorPlan((fan_in, rank), a_place, init=KAIMING_UNIFORM, tp_partial_grad=a_partial),
            TensorPlan((rank, fan_out), b_place, init=ZEROS, tp_partial_grad=b_partial))


@dataclass(frozen=True)
class AdapterKind:
    """How an adapter's update runs beside one kind of projection: the collective on its input (the base
    layer's own covers only its own branch), the one on x A, the adapter tensors whose gradient each tp rank
    computes only a part of, and those split over tp (name -> axis)."""

    on_input: str | None = None  # "identity"
    on_low: str | None = None  # "identity", "all_reduce", "reduce_scatter"
    partial: tuple[str, ...] = ()
    split: tuple[tuple[str, int], ...] = ()


KINDS = {
    "whole": AdapterKind(),
    "column": AdapterKind(on_low="identity", split=((LORA_B, 1),)),
    # SP: the block gathered x and reduce-scatters its gradient
    "column_gathered": AdapterKind(partial=(LORA_A,), split=((LORA_B, 1),)),
    "row": AdapterKind(on_low="all_reduce", split=((LORA_A, 0),)),
    # SP: the output's positions scattered
    "row_scattered": AdapterKind(on_low="reduce_scatter", partial=(LORA_B,), split=((LORA_A, 0),)),
    # whole on every rank, each using its heads
    "shared": AdapterKind(on_input="identity", partial=(LORA_A, LORA_B)),
    "shared_gathered": AdapterKind(partial=(LORA_A, LORA_B)),
    # an expert's projections under SP: partial sums on rows every tp rank holds (`SparseMoE.partial_projections`)
    "column_partial": AdapterKind(partial=(LORA_A,), split=((LORA_B, 1),)),
    "row_partial": AdapterKind(partial=(LORA_B,), split=((LORA_A, 0),)),
}


def kind_of(layer: nn.Layer, partial_sum: bool) -> str:
    """The adapter kind of a built projection (`partial_sum`: its MoE block runs it as a partial sum)."""
    if isinstance(layer, tp_layers.SharedColumnLinear):
        return "shared" if layer.tp_group is not None else "shared_gathered"
    if isinstance(layer, tp_layers.GatheredColumnLinear):
        return "column_gathered"
    if isinstance(layer, mp_layers.ColumnParallelLinear):
        return "column_partial" if partial_sum else "column"
    if isinstance(layer, sp_utils.RowSequenceParallelLinear):
        return "row_scattered"
    if isinstance(layer, mp_layers.RowParallelLinear):
        return "row_partial" if partial_sum else "row"
    return "whole"


class Adapter:
    """A projection's low-rank update: the forward post-hook of its layer (`__call__`), or the term its MoE
    block adds to the projection's partial sum (`term`, through `partial_linear`)."""

    def __init__(self, lora: LoRA, run: Execution, kind: str):
        self.scale, self.dropout, self.group, self.kind = lora.scale, lora.dropout, run.tp_group, kind
        self.how = KINDS[kind]

    def __call__(self, layer: nn.Layer, inputs: tuple, output: paddle.Tensor) -> paddle.Tensor:
        return output + self.term(layer, inputs[0])

    def term(self, layer: nn.Layer, x: paddle.Tensor) -> paddle.Tensor:
        if self.dropout and layer.training:
            x = F.dropout(x, self.dropout)
        if self.how.on_input == "identity":
            x = paddle.distributed.collective._c_identity(x, group=self.group)
        low = paddle.matmul(x, layer.lora_A)
        if self.how.on_low == "identity":
            low = paddle.distributed.collective._c_identity(low, group=self.group)
        elif self.how.on_low == "all_reduce":
            low = mp_ops._mp_allreduce(low, group=self.group, use_calc_stream=True, use_model_parallel=True)
        elif self.how.on_low == "reduce_scatter":
            low = sp_utils.ReduceScatterOp.apply(low)
        return paddle.scale(paddle.matmul(low, layer.lora_B), self.scale)

    def mark(self, param, name: str, weight) -> None:
        """An expert's adapter is the expert's; a piece split over tp is distributed as its weight (the hybrid
        clip sums its square over tp); a gradient each rank computes a part of is summed at the update."""
        if is_expert(weight):  # reduced over the expert's replicas only, skipped by fleet's broadcasts
            setattr(param, EXPERT_MARK, True)
        split = dict(self.how.split)
        if name in split:
            param.is_distributed, param.split_axis = weight.is_distributed, split[name]
        if self.kind.startswith("shared"):
            setattr(param, PARTIAL_OVER_HEADS, True)
        elif name in self.how.partial or (self.kind == "whole" and sp_utils.is_sequence_parallel_parameter(weight)):
            sp_utils.mark_as_sequence_parallel_parameter(param)


def partial_linear(layer: nn.Layer, x: paddle.Tensor, bias: bool = True) -> paddle.Tensor:
    """A projection on rows every tp rank holds without its collectives (an MoE block's partial sums under SP),
    with its adapter's term."""
    out = F.linear(x, layer.weight, layer.bias if bias else None)
    adapter = getattr(layer, "lora_adapter", None)
    return out if adapter is None else out + adapter.term(layer, x)


def adapted_paths(tensors) -> frozenset[str]:
    """The projections a plan (`with_adapters`) gives adapters."""
    return frozenset(name.removesuffix(f".{LORA_A}") for name in tensors if name.endswith(f".{LORA_A}"))


def attach_adapters(model: nn.Layer, lora: LoRA, run: Execution, tensors, single_name=lambda name: name) -> None:
    """Give each projection the model's plan `tensors` adapts its A and B (this rank's pieces, to be filled by
    the weights' initialisation or a load) and its hook; `single_name` maps a parameter's name in `model`
    to its single-card name (the pipeline's prefixes)."""
    adapted = adapted_paths(tensors)
    partial = {id(projection) for block in model.sublayers() if hasattr(block, "partial_projections")
               for projection in block.partial_projections()}
    for key, layer in list(model.named_sublayers()):
        if not isinstance(layer._parameters.get("weight"), paddle.Tensor):
            continue
        if single_name(f"{key}.weight").removesuffix(".weight") not in adapted:
            continue
        adapter = Adapter(lora, run, kind_of(layer, id(layer) in partial))
        local_in, local_out = layer.weight.shape
        for name, shape in ((LORA_A, [local_in, lora.rank]), (LORA_B, [lora.rank, local_out])):
            param = layer.create_parameter(shape, dtype=layer.weight.dtype,
                                           default_initializer=nn.initializer.Constant(0.0))
            adapter.mark(param, name, layer.weight)
            layer.add_parameter(name, param)
        layer.lora_B.optimize_attr["learning_rate"] = lora.plus_scale
        layer.lora_adapter = adapter
        layer.register_forward_post_hook(adapter)
