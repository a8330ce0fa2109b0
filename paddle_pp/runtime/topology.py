"""Turn a validated `Layout` into a running fleet: backend, strategy, groups and this rank's coordinates."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.utils.log_util import set_log_level

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.experts import ExpertGroup, build_expert_group
from paddle_pp.runtime.layout import Layout, launched_world_size
from paddle_pp.runtime.ring import build_ring
from paddle_pp.runtime.startup import quiet_one_process_fleet

T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """This rank's place in the layout and the communication group of every dimension."""

    layout: Layout
    hcg: Any
    global_rank: int
    dp_rank: int
    sharding_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int = 0
    ring: Any = None  # the cp ranks' `runtime.ring.Ring` when cp > 1
    experts: ExpertGroup | None = None  # the expert group and replicas when ep > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def data_replica_index(self) -> int:
        """Which slice of each global batch this rank reads: dp and sharding ranks read different data."""
        return self.dp_rank * self.layout.sharding_degree + self.sharding_rank

    @property
    def data_replica_count(self) -> int:
        return self.layout.data_replicas

    @property
    def weight_replica_index(self) -> int:
        """Which copy of its (stage, tp rank)'s weights this rank holds: dp, sharding and cp ranks are
        copies (`Layout.weight_replica`), what the checkpoint's writers and replica check see."""
        return self.layout.weight_replica(self.dp_rank, self.sharding_rank, self.cp_rank)

    @property
    def tp_group(self) -> Any:
        return self.hcg.get_model_parallel_group()

    @property
    def pp_group(self) -> Any:
        return self.hcg.get_pipe_parallel_group()

    @property
    def dp_group(self) -> Any:
        return self.hcg.get_data_parallel_group()

    @property
    def sharding_group(self) -> Any:
        return self.hcg.get_sharding_parallel_group()

    def coordinates(self) -> dict[str, int]:
        return {"dp": self.dp_rank, "sharding": self.sharding_rank, "tp": self.tp_rank, "pp": self.pp_rank,
                "cp": self.cp_rank, "ep": self.experts.rank if self.experts else 0}


# Parameters fleet keeps identical across TP ranks on GPU (matched in their internal names): its
# default list misses RMSNorm ("llama_rms_norm_0.w_0"), whose copies can then drift apart.
TP_SYNCED_PARAMETERS = ["embedding", "norm", ".b_"]


def build_strategy(layout: Layout, micro_batch_size: int = 1, accumulate_steps: int = 1) -> fleet.DistributedStrategy:
    """Fleet strategy for `layout`. Partial send/recv (each tp rank sends 1/tp of the activation, the
    receiver all-gathers) is on only on GPU without sequence parallelism: it assumes every tp rank
    holds the same activation, while under SP each holds its own slice of the sequence (PaddleNLP
    turns it off there too); on CPU gloo lacks the all-gather it needs.

    On GPU with TP, replicated parameters and their gradients are broadcast from TP rank 0 every
    step (PaddleNLP's `--tensor_parallel_config "sync_param sync_grad"`), as non-deterministic GPU
    kernels can make the copies drift; CPU runs are deterministic and skip it. Untested here (no GPU)."""
    strategy = fleet.DistributedStrategy()
    hybrid = layout.hybrid_configs()
    if layout.device != "cpu" and layout.tp > 1:
        hybrid["mp_configs"] = {"sync_param": True, "sync_grad": True, "sync_param_name": list(TP_SYNCED_PARAMETERS)}
    if layout.cp > 1:  # the global norm's tp sum over the tp then pp groups; its default "check" group spans cp too
        hybrid["split_norm_comm"] = True
    strategy.hybrid_configs = hybrid
    strategy.pipeline_configs = {
        "micro_batch_size": micro_batch_size,
        "accumulate_steps": accumulate_steps,
        "enable_partial_send_recv": layout.device != "cpu" and not layout.sequence_parallel,
    }
    return strategy


def init_distributed(layout: Layout, micro_batch_size: int = 1, accumulate_steps: int = 1) -> Topology:
    """Apply the CPU backend where needed, initialise fleet and return this rank's topology.

    The world size fleet sees must be the one the layout was validated against, so a layout built
    for another launch cannot reach a collective.
    """
    if layout.device == "cpu":
        from paddle_pp.runtime.backends import cpu

        cpu.apply()
        paddle.set_device("cpu")
        cpu.wait_for_job_store()
    actual_world = dist.get_world_size() if dist.is_initialized() else launched_world_size()
    if actual_world != layout.world_size:
        raise ValueError(
            f"layout {layout.describe()} was validated for {layout.world_size} processes but this job "
            f"has {actual_world}; pass the launcher's --nproc_per_node x --nnodes as the world size."
        )
    one_process = layout.world_size == 1  # Paddle's start-up notes would reach the user's terminal
    log_level = "WARNING" if one_process else "INFO"  # fleet's INFO lines: its strategy, its one-rank groups
    set_log_level(log_level)
    strategy = build_strategy(layout, micro_batch_size, accumulate_steps)
    with quiet_one_process_fleet() if one_process else contextlib.nullcontext():
        fleet.init(is_collective=True, strategy=strategy, log_level=log_level)
    hcg = fleet.get_hybrid_communicate_group()
    if layout.device == "cpu" and layout.pp > 1:
        cpu.create_pipeline_edge_groups(hcg, wrap_around=layout.vpp > 1)
    return Topology(
        layout=layout,
        hcg=hcg,
        global_rank=hcg.get_global_rank(),
        dp_rank=hcg.get_data_parallel_rank(),
        sharding_rank=hcg.get_sharding_parallel_rank(),
        tp_rank=hcg.get_model_parallel_rank(),
        pp_rank=hcg.get_stage_id(),
        cp_rank=hcg.get_sep_parallel_rank() if layout.cp > 1 else 0,
        ring=build_ring(hcg, layout.device) if layout.cp > 1 else None,
        experts=build_expert_group(hcg, layout) if layout.ep > 1 else None,
    )


def gather_objects(obj: Any, group: Any, size: int) -> list:
    """Every rank's `obj`, by rank, over `group` of `size` ranks (None: the whole job). A group of
    one calls no collective: a single-card run has no process group to call it on."""
    if size == 1:
        return [obj]
    out: list = []
    dist.all_gather_object(out, obj, group=group)
    return out


def align_ranks(topo: Topology) -> None:
    """Wait until every rank gets here, before a collective that follows uneven per-rank work.

    Only CPU needs it: gloo aborts any wait longer than 30 s, NCCL waits for minutes."""
    if topo.layout.device == "cpu" and topo.layout.world_size > 1:
        from paddle_pp.runtime.backends import cpu

        cpu.store_barrier()


def rank0_first(topo: Topology, key: str, work: Callable[[], T]) -> T:
    """Run `work` on global rank 0 first, then on the other ranks that call this: building shared
    files once (rank 0 must be among the callers). The others wait on the job's TCP store, not in a
    collective (gloo aborts any wait over 30 s); if rank 0 fails with a UserError they raise its
    message instead of waiting for ever."""
    if topo.layout.world_size == 1:
        return work()
    from paddle.base import core

    store, key = core.create_or_get_global_tcp_store(), f"paddle_pp/rank0_first/{key}"
    if topo.global_rank == 0:
        try:
            result = work()
        except UserError as err:
            store.set(key, f"error:{err}".encode())
            raise
        except BaseException:
            store.set(key, b"error:rank 0 failed; its log has the traceback")
            raise
        store.set(key, b"ok")
        return result
    store.wait(key)
    status = bytes(store.get(key)).decode()
    if status.startswith("error:"):
        raise UserError(status[len("error:"):])
    return work()


def end_job(topo: Topology, code: int = 0) -> int:
    """The process's last call once its results are written. On a multi-rank CPU job it does not
    return: ranks align and exit without C++ teardown (see `backends.cpu.exit_process`)."""
    if topo.layout.device == "cpu" and topo.layout.world_size > 1:
        from paddle_pp.runtime.backends import cpu

        cpu.exit_process(code)
    return code
