"""The parallel layout: one dataclass that owns the degrees, validates them and describes fleet.

Validation is pure Python and runs before Paddle creates any communicator, so a bad layout fails
in milliseconds on every rank with the same message instead of hanging in a rendezvous.
Flag names and semantics follow PaddleNLP's `TrainingArguments`, so users' launch scripts carry over.
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass, field
from typing import Sequence

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.flags import add_flags, flag

SHARDING_STAGES = ("stage1", "stage2", "stage3")
# Paddle's group_sharded_parallel level of each ZeRO stage it wraps (stage1 is fleet's sharding optimizer).
GROUP_SHARDED_LEVELS = {"stage2": "os_g", "stage3": "p_g_os"}

# PaddleNLP's two rank orders (outermost first); "mp" is innermost so TP peers share a node.
TOPO_ORDERS = {
    "pp_first": ["dp", "pp", "sharding", "sep", "mp"],
    "sharding_first": ["dp", "sharding", "pp", "sep", "mp"],
}

# The pipeline schedules of Paddle 3.3.1's fleet, by the names PaddleNLP's auto-parallel
# `pipeline_schedule_mode` gives them (DualPipeV: PaddleNLP's `use_dualpipev`). "auto" is fleet's own
# pick: 1F1B with one chunk per stage, with virtual stages VPP from 2 x pp micro-batches, FThenB below.
PIPELINE_SCHEDULES = ("auto", "1F1B", "VPP", "FThenB", "DualPipeV")


class LayoutError(UserError, ValueError):
    """A parallel layout that cannot run; the message names the flag and the fix."""


@dataclass(frozen=True)
class Layout:
    """Degrees of the layout; `dp` is derived as world / (tp * pp * sharding * cp).

    Context parallelism (cp) rides on fleet's `sep` axis (PaddleNLP passes its
    context_parallel_degree there too): cp ranks read the same samples and each holds its part of
    every sequence, hold the same weights, and sum their gradients (fleet all-reduces over dp x sep,
    averaging over dp only). So a data replica (what the sampler slices) is dp x sharding, while a
    weight replica (what the checkpoint and the replica check see) is dp x sharding x cp.

    `sharding_parallel_degree=-1` means "all data-parallel ranks that tp and pp leave", as in
    PaddleNLP; it is resolved in `__post_init__`, so every other field is concrete. Where PaddleNLP
    quietly reinterprets a request, so does the layout, and `notes` says what it did: stage2/3
    over one sharding rank trains unsharded.
    """

    world_size: int
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    sharding_parallel_degree: int = 1
    sharding: str = ""
    virtual_pp_degree: int = 1
    hybrid_parallel_topo_order: str = "pp_first"
    device: str = "cpu"
    sequence_parallel: bool = False
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    pipeline_schedule: str = "auto"
    dp: int = field(init=False)
    notes: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self._check_positive()
        stage = self.sharding_stage
        if stage and stage not in SHARDING_STAGES:
            raise LayoutError(
                f"--sharding {self.sharding!r} is not a sharding stage; use one of {', '.join(SHARDING_STAGES)}."
            )
        if len(self.sharding.split()) > 1:
            raise LayoutError(
                f"--sharding {self.sharding!r}: options after the stage ({' '.join(self.sharding.split()[1:])}) "
                f"are not supported (no CPU offload is implemented); pass --sharding {stage} alone.")
        if self.sharding_parallel_degree == -1:
            rest = self.world_size // (self.tensor_parallel_degree * self.pipeline_parallel_degree * self.cp)
            object.__setattr__(self, "sharding_parallel_degree", max(rest, 1) if stage else 1)
        if stage in GROUP_SHARDED_LEVELS and self.sharding_parallel_degree == 1:
            object.__setattr__(self, "sharding", "")
            object.__setattr__(self, "notes", (
                f"--sharding {stage} over one sharding rank means no sharding, as in PaddleNLP "
                "('sharding_parallel_degree=1 means no sharding'): training unsharded",))
            stage = ""
        if self.sharding_parallel_degree > 1 and not stage:
            raise LayoutError(
                f"--sharding_parallel_degree {self.sharding_parallel_degree} needs --sharding stage1 "
                "(or stage2/stage3); without it the ranks would silently run plain data parallel."
            )
        product = self.tensor_parallel_degree * self.pipeline_parallel_degree * self.sharding_parallel_degree * self.cp
        if self.world_size % product:
            context = f" x --context_parallel_degree {self.cp}" if self.cp > 1 else ""
            raise LayoutError(
                f"--tensor_parallel_degree {self.tensor_parallel_degree} x --pipeline_parallel_degree "
                f"{self.pipeline_parallel_degree} x --sharding_parallel_degree {self.sharding_parallel_degree}{context} "
                f"= {product} does not divide the world size {self.world_size}; launch a multiple of "
                f"{product} processes (python -m paddle.distributed.launch --nproc_per_node {product} ...) or "
                "lower a degree."
            )
        object.__setattr__(self, "dp", self.world_size // product)
        if stage in GROUP_SHARDED_LEVELS and self.pipeline_parallel_degree > 1:
            raise LayoutError(
                f"--sharding {stage} with --pipeline_parallel_degree {self.pipeline_parallel_degree} is refused, as "
                "PaddleNLP refuses it: Paddle's pipeline schedule composes only with stage1 (its group-sharded "
                "stage2/3 wrappers hook a whole model's forward and backward, which the schedule splits into "
                "micro-batches per stage); use --sharding stage1 with pipeline parallelism, or drop pp.")
        if self.virtual_pp_degree > 1 and self.pipeline_parallel_degree < 2:
            raise LayoutError(
                f"--virtual_pp_degree {self.virtual_pp_degree} needs --pipeline_parallel_degree >= 2; "
                "drop --virtual_pp_degree or add pipeline stages."
            )
        if self.virtual_pp_degree > 1 and self.pipeline_parallel_degree == 2 and self.device != "cpu":
            raise LayoutError(
                f"--virtual_pp_degree {self.virtual_pp_degree} with --pipeline_parallel_degree 2 is refused by "
                "Paddle's interleaved schedule on GPU (it asserts pp > 2: NCCL could pair the two messages to "
                "the single neighbour wrongly); use pp >= 3. The CPU backend routes them apart and allows it."
            )
        if self.sequence_parallel and self.tensor_parallel_degree < 2:
            raise LayoutError(
                "--sequence_parallel needs --tensor_parallel_degree >= 2: it splits along the sequence what tensor "
                "parallelism would hold whole on every tp rank; add tensor parallelism or drop --sequence_parallel.")
        if self.sequence_parallel and stage in GROUP_SHARDED_LEVELS:
            raise LayoutError(
                f"--sequence_parallel with --sharding {stage} is not supported yet (its tp gradient all-reduce and "
                f"{stage}'s gradient reduction both hook the backward pass; their order is untested here); use "
                "--sharding stage1 with --sequence_parallel, or drop one of them.")
        self._check_experts(stage)
        self._check_schedule()
        if self.hybrid_parallel_topo_order not in TOPO_ORDERS:
            raise LayoutError(
                f"--hybrid_parallel_topo_order {self.hybrid_parallel_topo_order!r} is unknown; "
                f"use one of {', '.join(TOPO_ORDERS)}."
            )

    def _check_experts(self, stage: str) -> None:
        """Expert parallelism takes its ranks from the data ranks (see `ep`, `expert_position`). When ep
        divides dp, each expert group is ep dp ranks of one sharding rank: sharding peers hold the same
        experts and stage1 partitions their states with the rest. Otherwise the groups run across the
        sharding ranks (ep must divide dp x sharding), and stage1 partitions the experts over their
        replicas instead of the sharding group (`runtime.expert_sharding`). Under cp each cp rank
        exchanges its own part of the sequences within its own expert group. Stage2/3's hooks reduce
        every gradient over the whole sharding group: not wired for experts."""
        ep = self.ep
        if ep == 1:
            return
        if self.data_replicas % ep:
            raise LayoutError(
                f"--expert_parallel_degree {ep} does not divide the data-parallel ranks {self.data_replicas} (dp "
                f"{self.dp} x sharding {self.sharding_degree}: world / (tp x pp x cp)); choose an ep that divides "
                f"{self.data_replicas}, or launch more processes.")
        if stage in GROUP_SHARDED_LEVELS:
            raise LayoutError(
                f"--expert_parallel_degree {ep} with --sharding {stage}: the experts' own gradient reduction is not "
                f"wired into {stage}'s sharded one (not implemented); use --sharding stage1, or no sharding.")

    def _check_schedule(self) -> None:
        """What a schedule needs of the degrees (what it needs of the micro-batches and the model is
        `planning.schedules.check_schedule`'s)."""
        schedule, pp, vpp = self.pipeline_schedule, self.pp, self.vpp
        if schedule not in PIPELINE_SCHEDULES:
            raise LayoutError(
                f"--pipeline_schedule {schedule!r} is unknown; use one of {', '.join(PIPELINE_SCHEDULES)}.")
        if schedule != "auto" and pp < 2:
            raise LayoutError(f"--pipeline_schedule {schedule} needs --pipeline_parallel_degree >= 2; drop it or add "
                              "pipeline stages.")
        if schedule in ("1F1B", "DualPipeV") and vpp > 1:
            raise LayoutError(
                f"--pipeline_schedule {schedule} with --virtual_pp_degree {vpp}: "
                + ("1F1B runs one chunk per stage" if schedule == "1F1B" else
                   "DualPipeV places its own two chunks per stage (Paddle asserts 'dualpipev is not compatible "
                   "with virtual pipeline')")
                + "; drop --virtual_pp_degree, or use --pipeline_schedule VPP or FThenB.")
        if schedule in ("VPP", "FThenB") and vpp < 2:
            raise LayoutError(f"--pipeline_schedule {schedule} interleaves virtual stages: it needs "
                              "--virtual_pp_degree >= 2.")

    @property
    def dualpipev(self) -> bool:
        """Whether each stage holds two chunks in a V: stage s the s-th and the (2 pp - 1 - s)-th, so the
        first stage holds the embedding and the head (DeepSeek's DualPipeV)."""
        return self.pipeline_schedule == "DualPipeV"

    @property
    def head_stage(self) -> int:
        """The pipeline stage holding what follows the decoder layers (the final norm, the head, the
        loss): the last, or the first in DualPipeV's V (`placement.Mesh.last_stage`)."""
        return 0 if self.dualpipev else self.pp - 1

    def _check_positive(self) -> None:
        if self.world_size < 1:
            raise LayoutError(f"world size {self.world_size} must be at least 1.")
        degrees = {
            "--tensor_parallel_degree": self.tensor_parallel_degree,
            "--pipeline_parallel_degree": self.pipeline_parallel_degree,
            "--virtual_pp_degree": self.virtual_pp_degree,
            "--context_parallel_degree": self.context_parallel_degree,
            "--expert_parallel_degree": self.expert_parallel_degree,
        }
        for name, value in degrees.items():
            if value < 1:
                raise LayoutError(f"{name} {value} must be a positive integer.")
        if self.sharding_parallel_degree < 1 and self.sharding_parallel_degree != -1:
            raise LayoutError(
                f"--sharding_parallel_degree {self.sharding_parallel_degree} must be a positive integer "
                "(or -1 for every data-parallel rank)."
            )

    @property
    def tp(self) -> int:
        return self.tensor_parallel_degree

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_degree

    @property
    def vpp(self) -> int:
        return self.virtual_pp_degree

    @property
    def cp(self) -> int:
        return self.context_parallel_degree

    @property
    def ep(self) -> int:
        """Expert-parallel degree: the experts of each MoE layer are split over ep data ranks (an expert
        group), which exchange tokens; the ranks holding the same experts (dp x sharding x cp / ep of
        them) are the experts' data replicas."""
        return self.expert_parallel_degree

    @property
    def experts_across_sharding(self) -> bool:
        """Whether an expert group spans sharding ranks (ep does not divide dp), so that sharding peers
        hold different experts: stage1 then partitions the experts over their replicas, outside its
        sharding partition (DeepSeek-V3's layout: ep64 inside a ZeRO-1 data group of 128)."""
        return self.ep > 1 and self.dp % self.ep != 0

    def expert_position(self, dp_rank: int, sharding_rank: int) -> tuple[int, int]:
        """(which expert group, which 1/ep of the experts) a data rank holds. When ep divides dp, the
        groups are ep consecutive dp ranks of one sharding rank; otherwise ep consecutive data ranks
        counted sharding-fastest (`Topology.data_replica_index`)."""
        if not self.experts_across_sharding:
            return (dp_rank // self.ep) * self.sharding_degree + sharding_rank, dp_rank % self.ep
        return divmod(dp_rank * self.sharding_degree + sharding_rank, self.ep)

    def expert_rank(self, dp_rank: int, sharding_rank: int) -> int:
        """Which 1/ep of the experts a data rank holds."""
        return self.expert_position(dp_rank, sharding_rank)[1]

    @property
    def sharding_degree(self) -> int:
        return self.sharding_parallel_degree

    @property
    def sharding_stage(self) -> str:
        """The stage word of `--sharding` ("stage1"), or "" when unsharded (options after it are refused)."""
        words = self.sharding.split()
        return words[0] if words else ""

    @property
    def group_sharded_level(self) -> str | None:
        """`group_sharded_parallel`'s level for stage2/stage3; None for stage1 (fleet's optimizer) or none."""
        return GROUP_SHARDED_LEVELS.get(self.sharding_stage)

    @property
    def data_replicas(self) -> int:
        """How many distinct batches one step reads: every dp and sharding rank sees its own data (the cp
        ranks of a data replica read the same samples)."""
        return self.dp * self.sharding_degree

    @property
    def order(self) -> list[str]:
        return list(TOPO_ORDERS[self.hybrid_parallel_topo_order])

    def rank_slots(self) -> list[tuple[int, int, int]]:
        """(pipeline stage, weight replica, tp rank) of each global rank: fleet numbers ranks row-major
        over `order`; the weight replica is `weight_replica(dp, sharding, cp rank)`."""
        sizes = {"dp": self.dp, "pp": self.pp, "sharding": self.sharding_degree, "sep": self.cp, "mp": self.tp}
        slots = []
        for index in itertools.product(*(range(sizes[dim]) for dim in self.order)):
            at = dict(zip(self.order, index))
            slots.append((at["pp"], self.weight_replica(at["dp"], at["sharding"], at["sep"]), at["mp"]))
        return slots

    def weight_replica(self, dp_rank: int, sharding_rank: int, cp_rank: int) -> int:
        """The index of a rank's copy of its stage's weights: cp outermost, so the sharding peers of a
        copy (stage3 gathers among them) are the indices sharing `index // sharding degree`."""
        return (cp_rank * self.dp + dp_rank) * self.sharding_degree + sharding_rank

    def hybrid_configs(self) -> dict:
        """Fleet's `strategy.hybrid_configs` for this layout."""
        return {
            "dp_degree": self.dp,
            "mp_degree": self.tp,
            "pp_degree": self.pp,
            "sharding_degree": self.sharding_degree,
            "sep_degree": self.cp,
            "order": self.order,
            "pp_configs": {"use_dualpipev": self.dualpipev},
        }

    def record(self) -> dict:
        """The layout as checkpoints record it (index `saving_layout`, trainer_state, split index)."""
        return {"describe": self.describe(), "world_size": self.world_size, "tensor_parallel_degree": self.tp,
                "pipeline_parallel_degree": self.pp, "sharding_parallel_degree": self.sharding_degree,
                "data_parallel_degree": self.dp, "virtual_pp_degree": self.vpp,
                "sharding": self.sharding_stage, "sequence_parallel": self.sequence_parallel,
                "context_parallel_degree": self.cp, "expert_parallel_degree": self.ep,
                "pipeline_schedule": self.pipeline_schedule}

    def flags(self) -> list[str]:
        """The command line's layout flags that give this layout (`from_args`' inverse)."""
        values = {"tensor_parallel_degree": self.tp, "pipeline_parallel_degree": self.pp,
                  "sharding_parallel_degree": self.sharding_degree, "virtual_pp_degree": self.vpp,
                  "context_parallel_degree": self.cp, "expert_parallel_degree": self.ep}
        out = [item for name, value in values.items() if value != 1 for item in (f"--{name}", str(value))]
        out += ["--sharding", self.sharding_stage] if self.sharding_stage else []
        out += ["--sequence_parallel"] if self.sequence_parallel else []
        if self.hybrid_parallel_topo_order != "pp_first":
            out += ["--hybrid_parallel_topo_order", self.hybrid_parallel_topo_order]
        if self.pipeline_schedule != "auto":
            out += ["--pipeline_schedule", self.pipeline_schedule]
        return out

    def describe(self) -> str:
        text = f"dp{self.dp} x sharding{self.sharding_degree} x tp{self.tp} x pp{self.pp}"
        if self.sharding_degree > 1:
            text += f" ({self.sharding_stage})"
        if self.vpp > 1:
            text += f" (vpp{self.vpp})"
        if self.dualpipev:
            text += " (DualPipeV)"
        if self.cp > 1:
            text += f" x cp{self.cp}"
        if self.ep > 1:
            text += f" (ep{self.ep})"
        if self.sequence_parallel:
            text += " + SP"
        return text

    def check_sequence_length(self, seq_len: int) -> None:
        """Context parallelism cuts every sequence into 2 x cp equal chunks, and sequence parallelism
        a rank's tokens into tp equal runs of positions."""
        if self.cp > 1:
            pieces = 2 * self.cp * (self.tp if self.sequence_parallel else 1)
            if seq_len % pieces:
                with_sp = f" x --tensor_parallel_degree {self.tp} (--sequence_parallel)" if self.sequence_parallel else ""
                raise LayoutError(
                    f"--max_seq_length {seq_len} is not divisible by 2 x --context_parallel_degree {self.cp}{with_sp} "
                    f"= {pieces}: each sequence is cut into 2 x cp equal chunks; use a multiple of {pieces}.")
        elif self.sequence_parallel and seq_len % self.tp:
            raise LayoutError(
                f"--max_seq_length {seq_len} is not divisible by --tensor_parallel_degree {self.tp}, which "
                f"--sequence_parallel splits it over; use a multiple of {self.tp} or drop --sequence_parallel.")

    @classmethod
    def from_args(cls, args: LayoutArguments | argparse.Namespace, world_size: int | None = None, device: str | None = None) -> "Layout":
        if getattr(args, "sep_parallel_degree", 1) not in (1, -1):
            raise LayoutError(
                f"--sep_parallel_degree {args.sep_parallel_degree}: PaddleNLP's segment parallelism is not implemented "
                "(PaddleNLP refuses it together with context parallelism); --context_parallel_degree cuts long "
                "sequences over ranks with ring attention. Use it instead.")
        return cls(
            world_size=world_size if world_size is not None else launched_world_size(),
            tensor_parallel_degree=args.tensor_parallel_degree,
            pipeline_parallel_degree=args.pipeline_parallel_degree,
            sharding_parallel_degree=args.sharding_parallel_degree,
            sharding=args.sharding,
            virtual_pp_degree=args.virtual_pp_degree,
            hybrid_parallel_topo_order=args.hybrid_parallel_topo_order,
            device=device if device is not None else launched_device(),
            sequence_parallel=args.sequence_parallel,
            context_parallel_degree=args.context_parallel_degree,
            expert_parallel_degree=getattr(args, "expert_parallel_degree", 1),
            pipeline_schedule=getattr(args, "pipeline_schedule", "auto"),
        )


def launched_world_size() -> int:
    """World size as `paddle.distributed.launch` exports it (1 for a plain `python` run)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def launched_rank() -> int:
    """This process's global rank as `paddle.distributed.launch` exports it (0 for a plain run)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def launched_device() -> str:
    """'gpu' when this Paddle build sees a CUDA device, else 'cpu' (the layout rules differ on CPU)."""
    import paddle

    return "gpu" if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "cpu"


@dataclass
class LayoutArguments:
    """The layout flags, under PaddleNLP's names; `Layout.from_args` validates them."""

    tensor_parallel_degree: int = flag(1, "tensor (model) parallel degree")
    pipeline_parallel_degree: int = flag(1, "pipeline parallel degree")
    sharding_parallel_degree: int = flag(
        1, "ranks that shard optimizer state; -1 = every data-parallel rank (needs --sharding)")
    sharding: str = flag("", "ZeRO stage over --sharding_parallel_degree ranks: stage1 (optimizer states), stage2 "
                         "(+ gradients), stage3 (+ parameters); stage2/3 need pp = 1")
    virtual_pp_degree: int = flag(1, "virtual stages per pipeline rank (interleaved 1F1B)")
    pipeline_schedule: str = flag(
        "auto", "the pipeline's schedule: auto (fleet's pick: 1F1B; with --virtual_pp_degree VPP from 2 x pp "
        "micro-batches, FThenB below), 1F1B, VPP, FThenB, DualPipeV (DeepSeek's V: two chunks per stage, the "
        "first stage holds the embedding and the head; 2 x pp micro-batches or more)",
        choices=list(PIPELINE_SCHEDULES))
    stage3_segment_size: int = flag(
        2**20, "stage3 slices only parameters of more elements than this (Paddle's segment_size); smaller ones "
        "stay whole on every sharding rank")
    sequence_parallel: bool = flag(
        False, "with tp: split the norm and residual activations along the sequence over the tp ranks "
        "(reduce-scatter / all-gather in place of TP's all-reduce); the sequence length must divide by tp")
    context_parallel_degree: int = flag(
        1, "ranks each sequence is cut over (ring attention; each rank holds 2 of 2 x cp chunks): for sequences "
        "longer than one rank holds; the sequence length must divide by 2 x cp (x tp with --sequence_parallel)")
    expert_parallel_degree: int = flag(
        1, "ranks each MoE layer's experts are split over, taken from the data-parallel ranks (must divide dp x "
        "sharding; when it does not divide dp, the expert groups run across the sharding ranks); tokens travel "
        "to their experts' ranks and back")
    sep_parallel_degree: int = flag(1, "PaddleNLP's segment parallelism (all-to-all of heads and sequence): not "
                                       "implemented; use --context_parallel_degree")
    hybrid_parallel_topo_order: str = flag(
        "pp_first", "rank order: pp_first = dp,pp,sharding,sep(cp),mp; sharding_first = dp,sharding,pp,sep(cp),mp",
        choices=sorted(TOPO_ORDERS))


def add_layout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the layout flags under their PaddleNLP names."""
    return add_flags(parser, LayoutArguments, "parallel layout (dp is derived: world / (tp * pp * sharding * cp))")


def parse_layout(argv: Sequence[str] | None = None, world_size: int | None = None, device: str | None = None) -> Layout:
    """Parse only the layout flags (others are left for the caller) and validate them."""
    parser = add_layout_args(argparse.ArgumentParser(add_help=False))
    args, _ = parser.parse_known_args(argv)
    return Layout.from_args(args, world_size=world_size, device=device)
