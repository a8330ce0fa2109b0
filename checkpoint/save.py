"""Saving from any layout: each tensor written once, by one rank, as a single-card tensor.

Who writes what is `checkpoint.writers.assign_writers`: every rank of the job, data replicas
included, takes a share balanced by bytes, from the lowest pipeline stage holding each tensor (a
tied embedding held by the first and last stage is written once). Each writer writes one shard
file per kind, whose index entry records its rank. A tensor split by TP is not gathered: every tp
rank of the writer's replica computes the writer's file layout from the same plan and writes its
piece into its place (`shards.PieceWriter`), and the file's CRC-32 is combined from the pieces'
(`crc32_ranges`) at commit. A stage3 flat slice is first gathered over its sharding group, to the
member in the writer's data replica (the whole sharding group of the writer's dp rank takes part,
one tensor at a time). What each rank does is data first (`save_tasks.save_tasks`, pure, tested for
whole jobs without a process), then carried out in order. Shard headers are written from the
planned shapes before any data, so a synchronous save streams one tensor at a time.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import numpy as np
import paddle

from checkpoint import commit as commits, crc32_ranges
from checkpoint.durable import fsync_file, write_json_durably
from checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    GRADIENTS,
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    TRAINER_STATE_FILE,
    index_name,
    tensor_nbytes,
)
from checkpoint.optimizer_state import state_tp_axis, states_by_parameter
from checkpoint.piece import Piece
from checkpoint.replicas import host_array, judge_replicas, replica_fingerprints
from checkpoint.save_tasks import (
    PIECE_IN_PLACE,
    SEND_SLICE,
    SHARD_METADATA,
    Holding,
    KindTasks,
    Task,
    holding_sizes,
    save_tasks,
    writer_files,
)
from checkpoint.shards import CHECKSUM, PieceWriter, ShardStream, TensorSpec
from checkpoint.stage3 import FlatSlice, as_saved, held_piece, model_tensors
from checkpoint.writers import WritePlan, assign_writers, items_from_holdings
from modeling.placement import ModelPlan
from paddle_pp.runtime.stage3 import slice_param_name
from paddle_pp.runtime.topology import Topology, gather_objects

Held = dict[str, dict[str, tuple["paddle.Tensor | FlatSlice", Piece]]]  # kind -> name -> (local, its part)


def _held(state: dict, tensors: dict, axes: dict, whole: frozenset[str], optimizer, gradients: dict | None,
          topo: Topology) -> Held:
    """Every tensor this rank could write, by kind: the model's `tensors` (`stage3.model_tensors` of
    `state`); optimizer states and recorded gradients only where this rank holds them (the sharding
    rank that updates the parameter, or under stage3 every sharding rank, each its slice). `axes` are
    the declared tp axes, `whole` the parameters this degree leaves whole despite theirs."""
    held: Held = {MODEL: {name: (tensor, held_piece(tensor, axes.get(name), topo, name in whole))
                          for name, tensor in tensors.items()}}
    per_parameter = {OPTIMIZER: states_by_parameter(optimizer) if optimizer is not None else None,
                     GRADIENTS: gradients}
    for kind, by_param in per_parameter.items():
        if by_param is not None:
            held[kind] = {f"{name}{STATE_SEPARATOR}{state_name}":
                          (saved, held_piece(saved, state_tp_axis(saved.shape, param.shape, axes.get(name)), topo,
                                             name in whole))
                          for name, param in state.items()
                          for state_name, tensor in by_param.get(slice_param_name(param), {}).items()
                          for saved in [as_saved(param, tensor, topo)]}
    return held


LOW_PRECISION = (paddle.bfloat16, paddle.float16)


def _written_dtype(kind: str, tensor: paddle.Tensor) -> np.dtype:
    """Weights in fp32, and any bf16/fp16 tensor widened (exactly) to fp32: a mixed-precision run's
    recorded gradients then read like an fp32 run's; other states keep their dtype (fp32 under AdamW)."""
    if kind == MODEL or tensor.dtype in LOW_PRECISION:
        return np.dtype("float32")
    return np.dtype(str(tensor.dtype).removeprefix("paddle."))


def _holdings(held: Held) -> dict[str, dict[str, Holding]]:
    """What this rank could write, as `save_tasks` takes it: each tensor's single-card spec as written
    and the part this rank holds."""
    return {kind: {name: Holding(TensorSpec(name, _written_dtype(kind, tensor), tuple(piece.full_shape(tensor.shape))),
                                 piece)
                   for name, (tensor, piece) in tensors.items()}
            for kind, tensors in held.items()}


def _report(holdings: dict[str, dict[str, Holding]], topo: Topology) -> dict:
    """This rank's holdings for the job's write plan (names, single-card bytes, TP-split, bytes
    gathered first) and where it sits."""
    return {"rank": topo.global_rank, "stage": topo.pp_rank, "replica": topo.weight_replica_index,
            "tp_rank": topo.tp_rank, "tensors": holding_sizes(holdings, topo.layout.tp)}


def _plan_writers(holdings: list[dict], tp: int) -> WritePlan:
    """The job's write plan from every rank's holdings (`_report`), the same on every rank."""
    groups: dict[tuple, list] = {}
    for rank in holdings:
        groups.setdefault((rank["stage"], rank["replica"]), []).append(
            {kind: sorted(names) for kind, names in rank["tensors"].items()})
    uneven = [group for group, peers in groups.items() if any(peer != peers[0] for peer in peers)]
    if uneven:  # each tp rank lays out its peers' files from its own tensors: they would disagree
        raise RuntimeError(f"the tp ranks of (stage, replica) {uneven[0]} hold different tensors; cannot save")
    return assign_writers(items_from_holdings(holdings), tp)


def _arrays(tasks: KindTasks, held: dict[str, tuple], holdings: dict[str, Holding],
            borrow: bool) -> Iterator[tuple[Task, np.ndarray]]:
    """Each task's array as written, in order: every stage3 gather is driven here (a rank that only
    sends its slice yields nothing for it); views of live tensors where `borrow` allows
    (`replicas.host_array`)."""
    for task in tasks.tasks:
        local = held[task.name][0]
        if isinstance(local, FlatSlice):
            local = local.gather(task.slice_root)
        if task.action != SEND_SLICE:
            yield task, host_array(local.detach(), holdings[task.name].spec.dtype.name, borrow)


def _write_kind(staged: Path, tasks: KindTasks, arrays: Iterable[tuple[Task, np.ndarray]],
                holdings: dict[str, Holding], topo: Topology, results: dict) -> None:
    """Carry out this rank's `tasks` of one kind: each tensor whole into its own file as it comes,
    each TP piece into its place in its tp group's writer's file."""
    pieces, streamed = PieceWriter(), 0
    own_file = ShardStream(staged / tasks.fname, list(tasks.specs), SHARD_METADATA, tasks.holes) \
        if tasks.fname is not None else contextlib.nullcontext()
    try:
        with own_file as own:
            for task, array in arrays:
                if task.action == PIECE_IN_PLACE:
                    place = task.place
                    results["pieces"].setdefault(place.fname, {})[task.name] = pieces.write(
                        staged / place.fname, place.file_size, place.offset, place.shape, task.piece, array)
                else:
                    own.put(array)
            if own is not None:
                entry = own.finish()
                results["shards"][tasks.kind] = (tasks.fname, entry | {"rank": topo.global_rank}, {
                    spec.name: {"dtype": str(spec.dtype), "shape": list(spec.shape),
                                "tp_axis": holdings[spec.name].piece.axis} for spec in tasks.specs})
                streamed = entry["size"] - sum(spec.nbytes for spec in tasks.specs if spec.name in tasks.holes)
    finally:
        pieces.close()
    results["written"][tasks.kind] = streamed + pieces.nbytes


class ModelRewrite(Protocol):
    """Rewrites the staged model kind (single-card tensors under our names) into another layout
    before the commit (`paddle_pp.interop.transformers_layout`): the checkpoint library knows no
    model. Every rank writes its share of the new files from the staged ones, then rank 0 replaces
    the staged model files and index with them."""

    def write_share(self, staged: Path, share: int, shares: int) -> dict: ...

    def replace(self, staged: Path, written: list[dict]) -> None: ...


@dataclass
class PendingSave:
    """A save whose shard files are being written; `finish()` commits it on every rank."""

    output_dir: Path
    step: int
    topo: Topology
    layout_info: dict
    plans: dict
    extra: dict
    keep: int
    rewrite: ModelRewrite | None = None
    thread: threading.Thread | None = None
    results: dict = field(default_factory=dict)
    error: list = field(default_factory=list)

    def files_written(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def finish(self) -> Path | None:
        """Wait for this rank's files, exchange their checksums, rewrite the weights (`rewrite`), and
        let rank 0 commit; returns the committed folder."""
        if self.thread is not None:
            self.thread.join()
        outcomes = gather_objects({"error": self.error, "results": self.results}, None, self.topo.layout.world_size)
        failed = [rank for rank, outcome in enumerate(outcomes) if outcome["error"]]
        if failed:
            raise RuntimeError(f"writing checkpoint-{self.step} failed on ranks {failed}: "
                               f"{outcomes[failed[0]]['error']}")
        everyone = [outcome["results"] for outcome in outcomes]
        staged = commits.temp_dir(self.output_dir, self.step)
        _on_every_rank(self, "indexing", lambda: _write_indexes(self, staged, everyone), rank0_only=True)
        if self.rewrite is not None:
            rewrite = self.rewrite
            shares = _on_every_rank(self, "rewriting the weights of",
                                    lambda: rewrite.write_share(staged, self.topo.global_rank, self.topo.layout.world_size))
            _on_every_rank(self, "rewriting the weights of", lambda: rewrite.replace(staged, shares), rank0_only=True)
        return _on_every_rank(self, "committing", self._commit_and_rotate, rank0_only=True)[0]

    def _commit_and_rotate(self) -> Path:
        final = commits.commit(self.output_dir, self.step)
        commits.rotate(self.output_dir, self.keep)
        return final


def _on_every_rank(pending: PendingSave, doing: str, work, rank0_only: bool = False) -> list:
    """Every rank's result of `work` (run on rank 0 alone with `rank0_only`), after all finished it: a
    failure on any rank is raised on every rank (its own error on the rank that failed), so none waits
    in a collective the failed one never joins, and the save is left uncommitted (the last checkpoint
    stays latest)."""
    own: Exception | None = None
    try:
        outcome = {"result": work() if pending.topo.global_rank == 0 or not rank0_only else None}
    except Exception as err:
        own, outcome = err, {"error": repr(err)}
    outcomes = gather_objects(outcome, None, pending.topo.layout.world_size)
    if own is not None:
        raise own
    failed = [rank for rank, outcome in enumerate(outcomes) if "error" in outcome]
    if failed:
        raise RuntimeError(f"{doing} checkpoint-{pending.step} failed on ranks {failed}: {outcomes[failed[0]]['error']}")
    return [outcome["result"] for outcome in outcomes]


def _with_pieces(fname: str, entry: dict, pieces: dict[tuple[str, str], list[int]], tp: int) -> dict:
    """A file's index entry with its exact CRC-32, from its writer's (holes as zeros) and the TP
    pieces written into its holes."""
    holes = entry.pop("holes", {})
    missing = [name for name in holes if len(pieces.get((fname, name), [])) != tp]
    if missing:
        raise RuntimeError(f"{fname}: the TP pieces of {missing[:3]} did not all arrive; the save is not committed")
    crc = crc32_ranges.combine(int(entry[CHECKSUM], 16), [(state, after) for name, after in holes.items()
                                                          for state in pieces[(fname, name)]])
    return entry | {CHECKSUM: f"{crc:08x}"}


def _write_indexes(pending: PendingSave, staged: Path, everyone: list[dict]) -> None:
    """Every kind's index from the ranks' results, and the save's other files, into `staged`."""
    pieces: dict[tuple[str, str], list[int]] = {}
    for result in everyone:
        for fname, states in result["pieces"].items():
            for name, state in states.items():
                pieces.setdefault((fname, name), []).append(state)
    for kind in {kind for result in everyone for kind in result["shards"]}:
        files, tensors, weight_map, total = {}, {}, {}, 0
        for result in everyone:
            if kind not in result["shards"]:
                continue
            fname, entry, specs = result["shards"][kind]
            files[fname] = _with_pieces(fname, entry, pieces, pending.topo.layout.tp)
            for name, meta in specs.items():
                tensors[name], weight_map[name] = meta, fname
                total += tensor_nbytes(meta)
        written = {str(rank): result["written"][kind] for rank, result in enumerate(everyone)
                   if result["written"].get(kind)}
        metadata = {"format_version": FORMAT_VERSION, "total_size": total, "saving_layout": pending.layout_info,
                    "files": files, "tensors": tensors, "bytes_written": written,
                    **pending.extra.get(f"{kind}_metadata", {})}
        write_json_durably(staged / index_name(kind), {"metadata": metadata, "weight_map": weight_map})
    for name, payload in pending.extra["json_files"].items():
        write_json_durably(staged / name, payload)
    for source in pending.extra["copy_files"]:
        shutil.copyfile(source, staged / Path(source).name)
        fsync_file(staged / Path(source).name)


def single_card_config(config, plan: ModelPlan) -> dict:
    """config.json in single-card form: the layout that saved the checkpoint is in its index."""
    values = config.to_dict()
    values.update(tensor_parallel_degree=1, tensor_parallel_rank=0, virtual_pp_degree=1, sequence_parallel=False,
                  architectures=[plan.architecture])
    return values


def model_metadata(plan: ModelPlan) -> dict:
    """What the model index records beside its tensors: the family and which names are one tensor."""
    return {"model_type": plan.model_type, "tied": [list(names) for names in plan.tied]}


def save_checkpoint(output_dir: Path, step: int, model, optimizer, topo: Topology, plan: ModelPlan, *,
                    config, trainer_state: dict, extra_files: tuple[Path, ...] = (), keep: int = 0,
                    asynchronous: bool = False, gradients: dict | None = None,
                    replica_check: str = "error", rewrite: ModelRewrite | None = None) -> PendingSave:
    """Write checkpoint-<step> under `output_dir`. Synchronous saves return committed; asynchronous
    ones return once host copies are taken, with a `PendingSave` to `finish()` later. `extra_files`
    (e.g. the tokenizer) are copied in; `gradients` ({parameter's internal name: {"grad": tensor}})
    adds a gradients kind, for alignment checks; `rewrite` turns the model's files into another
    layout before the commit (`ModelRewrite`). `replica_check` (see `replicas.judge_replicas`)
    runs before anything is created: a failed check leaves nothing behind. Four all-gathers of
    small objects in all (fingerprints with holdings; outcomes; indexes written; commit), two more
    with `rewrite`: rank 0 clears a stale folder of this step before the first, each rank that
    writes creates the folder after it. Each is a few tens of ms among 4 ranks on 2 cores."""
    output_dir = Path(output_dir)
    state = model.state_dict()
    tensors = model_tensors(state, topo)
    held = _held(state, tensors, plan.axes(), plan.whole_at(topo.layout.tp), optimizer, gradients, topo)
    staged = commits.temp_dir(output_dir, step)
    if topo.global_rank == 0:  # before the all-gather below, so no rank's folder below is cleared
        output_dir.mkdir(parents=True, exist_ok=True)
        commits.clear_stale_temp(output_dir, step)
    holdings = _holdings(held)
    reports = gather_objects({"fingerprints": replica_fingerprints(tensors, plan.tp_axes(topo.layout.tp), topo),
                              "holdings": _report(holdings, topo)}, None, topo.layout.world_size)
    everyone = [report["holdings"] for report in reports]
    judge_replicas([report["fingerprints"] for report in reports], replica_check)
    writers = _plan_writers(everyone, topo.layout.tp)
    files = writer_files(writers, everyone, list(held))
    me = (topo.pp_rank, topo.weight_replica_index, topo.tp_rank)
    plans = {kind: save_tasks(kind, holdings[kind], writers, files[kind], me, topo.layout.tp,
                              topo.layout.sharding_degree) for kind in held}
    if topo.global_rank == 0 or any(tasks.fname or any(task.place for task in tasks.tasks) for tasks in plans.values()):
        staged.mkdir(exist_ok=True)  # only once the checks passed: a failed one leaves nothing
    layout_info = topo.layout.record()
    extra = {"json_files": {CONFIG_FILE: single_card_config(config, plan),
                            TRAINER_STATE_FILE: {"format_version": FORMAT_VERSION, "saving_layout": layout_info,
                                                 **trainer_state}},
             "copy_files": [str(path) for path in extra_files],
             "model_metadata": model_metadata(plan)}
    pending = PendingSave(output_dir, step, topo, layout_info, plans, extra, keep, rewrite)
    results = pending.results = {"shards": {}, "pieces": {}, "written": {}}
    if asynchronous:
        copies = {kind: list(_arrays(tasks, held[kind], holdings[kind], borrow=False)) for kind, tasks in plans.items()}

        def background():
            try:
                for kind, tasks in plans.items():
                    _write_kind(staged, tasks, copies[kind], holdings[kind], topo, results)
            except Exception as err:  # reported by finish() on every rank
                pending.error.append(repr(err))

        pending.thread = threading.Thread(target=background, name=f"checkpoint-{step}-writer", daemon=False)
        pending.thread.start()
        return pending
    for kind, tasks in plans.items():
        _write_kind(staged, tasks, _arrays(tasks, held[kind], holdings[kind], borrow=True), holdings[kind], topo,
                    results)
    pending.finish()
    return pending
