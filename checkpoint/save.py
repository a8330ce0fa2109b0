"""Saving from any layout: each tensor written once, by one rank, as a single-card tensor.

Who writes what is `checkpoint.writers.assign_writers`: every rank of the job, data replicas
included, takes a share balanced by bytes, from the lowest pipeline stage holding each tensor (a
tied embedding held by the first and last stage is written once); a tensor split by TP is
gathered to the writer over its tp group; a stage3 flat slice first over its sharding group, to
the member in the writer's data replica (the whole sharding group of the writer's dp rank takes
part, one tensor at a time). Each writer
writes one shard file per kind, whose index entry records its rank. Shard headers are written
from the planned shapes before any data, so a synchronous save streams one tensor at a time.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import paddle
import paddle.distributed as dist

from checkpoint import commit as commits
from checkpoint.durable import fsync_file, write_json_durably
from checkpoint.format import (
    CONFIG_FILE, FORMAT_VERSION, GRADIENTS, MODEL, OPTIMIZER, STATE_SEPARATOR, TRAINER_STATE_FILE, index_name, shard_name,
    tensor_nbytes,
)
from checkpoint.optimizer_state import state_tp_axis, states_by_parameter
from checkpoint.replicas import host_array, judge_replicas, replica_fingerprints
from checkpoint.shards import TensorSpec, write_shard
from checkpoint.stage3 import FlatSlice, as_saved, model_tensors, slice_param_name
from checkpoint.writers import WritePlan, assign_writers, items_from_holdings
from modeling.registry import family_of
from modeling.tp_plan import single_card_shape
from paddle_pp.runtime.topology import Topology, gather_objects


@dataclass
class _Entry:
    """One tensor this rank's tp group assembles (or this rank alone writes, when not TP-split)."""

    name: str
    local: paddle.Tensor | FlatSlice
    axis: int | None
    tp_gather: bool  # this rank's tp group gathers it
    mine: bool  # this rank writes it
    writer: int  # the tp rank that writes it
    slice_root: int  # the sharding rank in the writer's data replica (a stage3 slice is gathered there)


@dataclass
class _Shard:
    kind: str
    specs: list[TensorSpec] = field(default_factory=list)
    entries: list[_Entry] = field(default_factory=list)


Held = dict[str, dict[str, tuple["paddle.Tensor | FlatSlice", "int | None"]]]  # kind -> name -> (local, TP axis)


def _held(state: dict, tensors: dict, axes: dict, optimizer, gradients: dict | None, topo: Topology) -> Held:
    """Every tensor this rank could write, by kind: the model's `tensors` (`stage3.model_tensors` of
    `state`); optimizer states and recorded gradients only where this rank holds them (the sharding
    rank that updates the parameter, or under stage3 every sharding rank, each its slice)."""
    held: Held = {MODEL: {name: (tensor, axes.get(name)) for name, tensor in tensors.items()}}
    per_parameter = {OPTIMIZER: states_by_parameter(optimizer) if optimizer is not None else None,
                     GRADIENTS: gradients}
    for kind, by_param in per_parameter.items():
        if by_param is not None:
            held[kind] = {f"{name}{STATE_SEPARATOR}{state_name}": (saved, state_tp_axis(saved.shape, param.shape,
                                                                                         axes.get(name)))
                          for name, param in state.items()
                          for state_name, tensor in by_param.get(slice_param_name(param), {}).items()
                          for saved in [as_saved(param, tensor, topo)]}
    return held


def _written_dtype(kind: str, tensor: paddle.Tensor) -> np.dtype:
    return np.dtype("float32") if kind == MODEL else np.dtype(str(tensor.dtype).removeprefix("paddle."))


def _holdings(held: Held, topo: Topology) -> dict:
    """What this rank could write (names, single-card bytes, TP-split) and where it sits."""
    tp = topo.layout.tp
    return {"rank": topo.global_rank, "stage": topo.pp_rank, "replica": topo.data_replica_index,
            "tp_rank": topo.tp_rank, "tensors": {
                kind: {name: [int(np.prod(single_card_shape(t.shape, axis, tp))) * _written_dtype(kind, t).itemsize,
                              axis is not None and tp > 1] for name, (t, axis) in tensors.items()}
                for kind, tensors in held.items()}}


def _plan_writers(holdings: list[dict], tp: int) -> WritePlan:
    """The job's write plan from every rank's holdings (`_holdings`), the same on every rank."""
    groups: dict[tuple, list] = {}
    for rank in holdings:
        groups.setdefault((rank["stage"], rank["replica"]), []).append(
            {kind: sorted(names) for kind, names in rank["tensors"].items()})
    uneven = [group for group, peers in groups.items() if any(peer != peers[0] for peer in peers)]
    if uneven:  # a TP gather of a tensor some peer lacks would never finish
        raise RuntimeError(f"the tp ranks of (stage, replica) {uneven[0]} hold different tensors; cannot save")
    return assign_writers(items_from_holdings(holdings), tp)


def _file_names(plan: WritePlan, holdings: list[dict], kinds: list[str], rank: int) -> dict[str, str | None]:
    """This rank's shard file name per kind: writers of a kind are numbered in rank order."""
    rank_of = {(h["stage"], h["replica"], h["tp_rank"]): h["rank"] for h in holdings}
    names: dict[str, str | None] = {}
    for kind in kinds:
        writers = sorted({rank_of[slot] for (k, _), slot in plan.writer.items() if k == kind})
        names[kind] = shard_name(kind, writers.index(rank) + 1, len(writers)) if rank in writers else None
    return names


def _shard(kind: str, tensors: dict, plan: WritePlan, topo: Topology) -> _Shard:
    """This rank's part in saving `kind`: the tensors its tp group (and, for stage3 slices, its
    sharding group) assembles, the ones it writes."""
    shard, tp, sharding = _Shard(kind), topo.layout.tp, topo.layout.sharding_degree
    for name in sorted(tensors):
        stage, replica, writer = plan.writer[(kind, name)]
        tensor, axis = tensors[name]
        split, mine = axis is not None and tp > 1, writer == topo.tp_rank
        ours = (stage, replica) == (topo.pp_rank, topo.data_replica_index)
        mine = mine and ours
        if isinstance(tensor, FlatSlice):  # every sharding peer of a tp rank that takes part gathers with it
            takes_part = (stage, replica // sharding) == (topo.pp_rank, topo.dp_rank) and \
                (split or writer == topo.tp_rank)
        else:
            takes_part = ours and (split or mine)
        if not takes_part:
            continue
        shard.entries.append(_Entry(name, tensor, axis, split and ours, mine, writer, replica % sharding))
        if mine:
            shard.specs.append(TensorSpec(name, _written_dtype(kind, tensor),
                                          tuple(single_card_shape(tensor.shape, axis, tp))))
    return shard


def _assembled(shard: _Shard, topo: Topology, cast: str | None, borrow: bool) -> Iterator[np.ndarray]:
    """Drive every gather of the shard's entries in order; yield the tensors this rank writes
    (views of live tensors where `borrow` allows, see `replicas.host_array`)."""
    for entry in shard.entries:
        local = entry.local
        if isinstance(local, FlatSlice):
            local = local.gather(entry.slice_root)
            if local is None:  # a sharding peer outside the writer's replica: it only sent its slice
                continue
        local = local.detach()
        if entry.tp_gather:  # to the writer only: an all-gather would send every piece to every tp rank
            parts = [paddle.empty_like(local) for _ in range(topo.layout.tp)] if entry.mine else []
            dist.gather(local, parts, dst=topo.tp_group.ranks[entry.writer], group=topo.tp_group)
            if entry.mine:
                yield np.concatenate([host_array(p, cast, borrow) for p in parts], axis=entry.axis)
        elif entry.mine:
            yield host_array(local, cast, borrow)


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
    thread: threading.Thread | None = None
    results: dict = field(default_factory=dict)
    error: list = field(default_factory=list)

    def files_written(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def finish(self) -> Path | None:
        """Wait for this rank's files, exchange their checksums, and let rank 0 commit."""
        if self.thread is not None:
            self.thread.join()
        outcomes = gather_objects({"error": self.error, "results": self.results}, None, self.topo.layout.world_size)
        failed = [rank for rank, outcome in enumerate(outcomes) if outcome["error"]]
        if failed:
            raise RuntimeError(f"writing checkpoint-{self.step} failed on ranks {failed}: "
                               f"{outcomes[failed[0]]['error']}")
        everyone = [outcome["results"] for outcome in outcomes]
        final = None
        if self.topo.global_rank == 0:
            final = _commit(self, everyone)
        gather_objects(None, None, self.topo.layout.world_size)  # nobody returns before the commit
        return final


def _commit(pending: PendingSave, everyone: list[dict]) -> Path:
    staged = commits.temp_dir(pending.output_dir, pending.step)
    for kind in {kind for result in everyone for kind in result}:
        files, tensors, weight_map, total = {}, {}, {}, 0
        for result in everyone:
            if kind not in result:
                continue
            fname, entry, specs = result[kind]
            files[fname] = entry
            for name, meta in specs.items():
                tensors[name], weight_map[name] = meta, fname
                total += tensor_nbytes(meta)
        metadata = {"format_version": FORMAT_VERSION, "total_size": total, "saving_layout": pending.layout_info,
                    "files": files, "tensors": tensors, **pending.extra.get(f"{kind}_metadata", {})}
        write_json_durably(staged / index_name(kind), {"metadata": metadata, "weight_map": weight_map})
    for name, payload in pending.extra["json_files"].items():
        write_json_durably(staged / name, payload)
    for source in pending.extra["copy_files"]:
        shutil.copyfile(source, staged / Path(source).name)
        fsync_file(staged / Path(source).name)
    final = commits.commit(pending.output_dir, pending.step)
    commits.rotate(pending.output_dir, pending.keep)
    return final


def single_card_config(config) -> dict:
    """config.json in single-card form: the layout that saved the checkpoint is in its index."""
    values = config.to_dict()
    values.update(tensor_parallel_degree=1, tensor_parallel_rank=0, virtual_pp_degree=1,
                  architectures=[family_of(config).architecture])
    return values


def model_metadata(config) -> dict:
    """What the model index records beside its tensors: the family and which names are one tensor."""
    return {"model_type": config.model_type, "tied": family_of(config).tied_groups(config)}


def save_checkpoint(output_dir: Path, step: int, model, optimizer, topo: Topology, axes: dict, *,
                    config, trainer_state: dict, extra_files: tuple[Path, ...] = (), keep: int = 0,
                    asynchronous: bool = False, gradients: dict | None = None,
                    replica_check: str = "error") -> PendingSave:
    """Write checkpoint-<step> under `output_dir`. Synchronous saves return committed; asynchronous
    ones return once host copies are taken, with a `PendingSave` to `finish()` later. `extra_files`
    (e.g. the tokenizer) are copied in; `gradients` ({parameter's internal name: {"grad": tensor}})
    adds a gradients kind, for alignment checks. `replica_check` (see `replicas.judge_replicas`)
    runs before anything is created: a failed check leaves nothing behind. Three all-gathers of
    small objects in all (fingerprints with holdings; outcomes; end of commit): rank 0 clears a stale
    folder of this step before the first, each rank that writes creates the folder after it. Each is
    a few tens of ms among 4 ranks on 2 cores."""
    output_dir = Path(output_dir)
    state = model.state_dict()
    tensors = model_tensors(state, topo)
    held = _held(state, tensors, axes, optimizer, gradients, topo)
    staged = commits.temp_dir(output_dir, step)
    if topo.global_rank == 0:  # before the all-gather below, so no rank's folder below is cleared
        output_dir.mkdir(parents=True, exist_ok=True)
        commits.clear_stale_temp(output_dir, step)
    reports = gather_objects({"fingerprints": replica_fingerprints(tensors, axes, topo),
                              "holdings": _holdings(held, topo)}, None, topo.layout.world_size)
    holdings = [report["holdings"] for report in reports]
    judge_replicas([report["fingerprints"] for report in reports], replica_check)
    writers = _plan_writers(holdings, topo.layout.tp)
    names = _file_names(writers, holdings, list(held), topo.global_rank)
    if topo.global_rank == 0 or any(names.values()):  # only once the checks passed: a failed one leaves nothing
        staged.mkdir(exist_ok=True)
    plans = {kind: (names[kind], _shard(kind, tensors, writers, topo)) for kind, tensors in held.items()}
    layout_info = topo.layout.record()
    extra = {"json_files": {CONFIG_FILE: single_card_config(config),
                            TRAINER_STATE_FILE: {"format_version": FORMAT_VERSION, "saving_layout": layout_info,
                                                 **trainer_state}},
             "copy_files": [str(path) for path in extra_files],
             "model_metadata": model_metadata(config)}
    pending = PendingSave(output_dir, step, topo, layout_info, plans, extra, keep)

    def write(kind: str, fname: str | None, shard: _Shard, arrays) -> None:
        if fname is None:
            for _ in arrays:
                pass
            return
        entry = write_shard(staged / fname, shard.specs, arrays, {"format": "np"}) | {"rank": topo.global_rank}
        pending.results[kind] = (fname, entry, {s.name: {"dtype": str(s.dtype), "shape": list(s.shape),
                                                             "tp_axis": _axis_of(shard, s.name)} for s in shard.specs})

    if asynchronous:
        copies = {kind: (fname, shard, list(_assembled(shard, topo, "float32" if kind == MODEL else None, False)))
                  for kind, (fname, shard) in plans.items()}

        def background():
            try:
                for kind, (fname, shard, arrays) in copies.items():
                    write(kind, fname, shard, arrays)
            except Exception as err:  # reported by finish() on every rank
                pending.error.append(repr(err))

        pending.thread = threading.Thread(target=background, name=f"checkpoint-{step}-writer", daemon=False)
        pending.thread.start()
        return pending
    for kind, (fname, shard) in plans.items():
        write(kind, fname, shard, _assembled(shard, topo, "float32" if kind == MODEL else None, True))
    pending.finish()
    return pending


def _axis_of(shard: _Shard, name: str) -> int | None:
    return next(e.axis for e in shard.entries if e.name == name)

