"""How one run computes a model, beside what the model is.

A model's config (config.json) says what the network is; `Execution` says how this run computes
it: the tensor-parallel degree and rank, sequence parallelism, pipeline chunks, the attention core,
which activations are recomputed and which fused kernels run. It is built once per run, handed to
the model's constructor and from there to every block, so a run-time choice never becomes a config
field (nor leaks into a saved config.json) and a new axis adds a field here, not a branch on the
config in every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import paddle
from paddle.distributed.fleet.utils import recompute as fleet_recompute

from modeling.attention_core import CORES, AttentionCore, DenseCost, choose_core
from modeling.attention_core.ring import Ring
from modeling.attention_core.spec import PLAIN, CoreSpec
from modeling.context_parallel import local_positions
from modeling.documents import Documents
from modeling.indexer_training import IndexerTraining
from modeling.recurrent_core import RecurrentCore
from modeling.router_stats import RouterStats
from modeling.saved_tensors import recomputed_region
from modeling.step_loss import StepLoss
from paddle_pp.runtime.experts import ExpertGroup

GRANULARITIES = ("full", "full_attn", "core_attn")  # PaddleNLP's recompute_granularity values


@dataclass(frozen=True)
class Recompute:
    """PaddleNLP's recompute: what a decoder layer recomputes in backward instead of keeping
    (`granularity` None: nothing): the whole layer (full), its attention block with the projections
    (full_attn) or only the attention core (core_attn)."""

    granularity: str | None = None
    use_reentrant: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in (None, *GRANULARITIES):
            raise ValueError(f"recompute granularity {self.granularity!r} is not one of {GRANULARITIES}")

    def __call__(self, scope: str, function: Callable, *inputs: paddle.Tensor, training: bool = True):
        """`function(*inputs)`, recomputed in backward when `scope` is this run's granularity. Only
        when an input carries a gradient: recomputing a stop_gradient pipeline input hangs the
        schedule in reentrant mode (PaddleNLP#7235), and a region without gradients needs nothing.
        Its second run (the recomputation) runs under `recomputing()`, so what a layer counts once per
        forward (the experts' loads the balancing rule reads) is not counted twice; both runs inside
        `recomputed_region()`, where our PyLayers save strided tensors as copies (`saved_tensors`)."""
        if self.granularity == scope and training and any(not t.stop_gradient for t in inputs):
            runs = [0]

            def counted(*args):
                runs[0] += 1
                with recomputed_region():
                    if runs[0] == 1:
                        return function(*args)
                    _RECOMPUTING[0] += 1
                    try:
                        return function(*args)
                    finally:
                        _RECOMPUTING[0] -= 1

            return fleet_recompute(counted, *inputs, use_reentrant=self.use_reentrant)
        return function(*inputs)


_RECOMPUTING = [0]  # how many recomputations are running (they nest: a layer's within the whole step's)


def recomputing() -> bool:
    """Whether the code running is a recomputation in backward of a forward that already ran."""
    return _RECOMPUTING[0] > 0


@dataclass(frozen=True)
class Kernels:
    """Fused kernels this run uses in place of the reference ops (each chosen on GPU only)."""

    fused_rope: bool = False  # paddle.incubate fused_rotary_position_embedding
    fused_rms_norm: bool = False  # paddle.incubate fused_rms_norm (SIGILL on AVX2 CPUs: never on CPU)
    swiglu: bool = False  # paddle.nn.functional.swiglu for silu-gated MLPs


@dataclass(frozen=True)
class Execution:
    """The run's way of computing a model; the default is one card, dense attention, nothing fused."""

    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    vpp: int = 1  # virtual pipeline chunks per stage (the stage split reads it)
    dualpipev: bool = False  # DualPipeV's two chunks per stage in a V (the stage split reads it)
    tp_group: Any = None  # tensor parallelism (tp > 1): the group the blocks' own tp collectives run over
    ring: Ring | None = None  # context parallelism: the cp ranks sharing each sequence
    experts: ExpertGroup | None = None  # expert parallelism: which experts this rank holds, and the exchange
    attention: AttentionCore = field(default_factory=lambda: CORES["dense"])
    recurrent: RecurrentCore = field(default_factory=RecurrentCore)  # recurrent mixers' rule (Gated DeltaNet's)
    recompute: Recompute = field(default_factory=Recompute)
    kernels: Kernels = field(default_factory=Kernels)
    accumulate_steps: int = 1  # micro-batches per step: a loss injected inside the model is scaled by its inverse
    documents: tuple[int, ...] | None = None  # positions restart after these end-of-document token ids (None: off)
    within_documents: bool = True  # with `documents`: attention stays inside each (False: spans the packed sample)
    router_stats: RouterStats = field(default_factory=RouterStats, compare=False)  # MoE layers' routing, for metrics
    # each training micro-batch's loss of each multi-token prediction depth (the criterion's), for metrics
    prediction_losses: list = field(default_factory=list, compare=False)
    indexers: IndexerTraining = field(default_factory=IndexerTraining, compare=False)  # sparse attention's
    step_loss: StepLoss = field(default_factory=StepLoss, compare=False)  # the loss per optimizer step's weight

    def positions(self, local_len: int) -> np.ndarray | None:
        """The sequence positions of this rank's `local_len` tokens under context parallelism (None
        without: 0..local_len - 1)."""
        if self.ring is None:
            return None
        return local_positions(local_len * self.ring.degree, self.ring.degree, self.ring.rank)

    def documents_at(self, positions: paddle.Tensor | None, spec: CoreSpec = PLAIN,
                     lead: tuple[int, int] | None = None) -> Documents | None:
        """Where the documents of this rank's queries start, from their positions inside their documents
        (None: one causal stream); sequence positions, which under context parallelism are not 0..n-1.
        A chunked layer's (`spec.chunk`) start at their chunk too: `lead` is its (batch, local length)."""
        documents = None
        if positions is not None and self.within_documents:
            documents = Documents.of(positions, self.positions(positions.shape[1]))
        if spec.chunk is None:
            return documents
        batch, local = lead
        held = self.positions(local)
        return Documents.in_chunks(spec.chunk, np.arange(local) if held is None else held, documents, batch)

    def spec_for(self, spec: CoreSpec) -> CoreSpec:
        """A layer's attention spec as this run computes it (inside documents, when per-document or chunked)."""
        within = (self.documents is not None and self.within_documents) or spec.chunk is not None
        return replace(spec, documents=True) if within else spec

    @property
    def cp(self) -> tuple[int, int]:
        """(context-parallel degree, this rank's place): (1, 0) without."""
        return (self.ring.degree, self.ring.rank) if self.ring is not None else (1, 0)

    @property
    def sequence_first(self) -> bool:
        """Activations are [seq, batch, hidden] (sequence parallelism cuts the sequence over tp)."""
        return self.sequence_parallel and self.tp > 1


def choose_execution(use_flash_attention: bool = True, recompute: bool = False, granularity: str = "full",
                     use_reentrant: bool = False, fused_rope: bool = False, fused_rms_norm: bool = False,
                     device: str = "cpu", dtype: str | None = None, head_dim: int = 64,
                     sm: tuple[int, int] | None = None,
                     dense_cost: DenseCost | None = None, attention_core: str = "auto") -> tuple[Execution, list[str]]:
    """The run's attention core, recompute and kernels from PaddleNLP's flags of the same names, for
    `device` and the compute `dtype` (None: fp32), and notes on what was asked for and not taken.
    Fused kernels run on a GPU only (PaddleNLP switches fused rope off elsewhere with a warning; the
    others have no CPU kernel, or kill the process: fused_rms_norm on AVX2); SwiGLU is fused on GPU
    as in PaddleNLP's LLaMA. The granularity counts only with `recompute`, as in PaddleNLP."""
    core, reason = choose_core(use_flash_attention, device, dtype, head_dim, sm, dense_cost, attention_core)
    notes = [f"attention: {core.name} core ({reason})"] if reason else []
    gpu = device == "gpu"
    for name, asked in (("--use_fused_rope", fused_rope), ("--use_fused_rms_norm", fused_rms_norm)):
        if asked and not gpu:
            notes.append(f"{name} ignored on {device}: the kernel runs on GPU only (the reference op runs, "
                         "same numbers)")
    kernels = Kernels(fused_rope=fused_rope and gpu, fused_rms_norm=fused_rms_norm and gpu, swiglu=gpu)
    return Execution(attention=core, recompute=Recompute(granularity if recompute else None, use_reentrant),
                     kernels=kernels), notes
