"""Saving from any layout: each tensor written once, by one rank, as a single-card tensor.

Who writes what: a tensor belongs to the lowest pipeline stage that holds it (a tied embedding
held by the first and last stage is written once), and only the first data replica (dp rank 0)
writes. Within a stage, model tensors are spread over the tp x sharding ranks of that replica
and optimizer states over the tp ranks of the sharding rank that updates them; a tensor split by
TP is all-gathered over its tp group and written by the one owner. Shard headers are written from
the planned shapes before any data, so a synchronous save streams one tensor at a time.
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
from checkpoint.replicas import check_replicas, host_array
from checkpoint.shards import TensorSpec, write_shard
from modeling.registry import family_of
from modeling.tp_plan import single_card_shape
from paddle_pp.runtime.topology import Topology, gather_objects


@dataclass
class _Entry:
    """One tensor to save: its local tensor, TP axis, and whether this rank writes it."""

    name: str
    local: paddle.Tensor
    axis: int | None
    gather: bool  # this rank's tp group takes part in assembling it
    mine: bool  # this rank writes it


@dataclass
class _Shard:
    kind: str
    specs: list[TensorSpec] = field(default_factory=list)
    entries: list[_Entry] = field(default_factory=list)


def _owned_names(state: dict, topo: Topology) -> list[str]:
    """Names this stage writes: those no lower stage also holds (tied weights go to the first)."""
    names = sorted(state)
    stages = gather_objects(names, topo.pp_group, topo.layout.pp)
    earlier = {n for stage in stages[:topo.pp_rank] for n in stage}
    return [n for n in names if n not in earlier]


def _model_shard(state: dict, owned: list[str], axes: dict, topo: Topology) -> _Shard:
    tp, writers = topo.layout.tp, topo.layout.tp * topo.layout.sharding_degree
    shard = _Shard(MODEL)
    for i, name in enumerate(owned):
        slot = i % writers
        gather = topo.dp_rank == 0 and topo.sharding_rank == slot // tp
        entry = _Entry(name, state[name], axes.get(name), gather, gather and topo.tp_rank == slot % tp)
        shard.entries.append(entry)
        if entry.mine:
            full = tuple(single_card_shape(entry.local.shape, entry.axis, tp))
            shard.specs.append(TensorSpec(name, np.dtype("float32"), full))
    return shard


def _per_parameter_shard(kind: str, state: dict, owned: list[str], by_param: dict, axes: dict,
                         topo: Topology) -> _Shard:
    """Optimizer states (or recorded gradients), which only the sharding rank updating a parameter holds."""
    tp = topo.layout.tp
    keyed = {}
    for name in owned:
        param = state[name]
        for state_name, tensor in by_param.get(param.name, {}).items():
            keyed[f"{name}{STATE_SEPARATOR}{state_name}"] = (tensor, state_tp_axis(tensor.shape, param.shape,
                                                                                    axes.get(name)))
    counts = gather_objects(len(keyed), topo.tp_group, tp)
    if len(set(counts)) > 1:
        raise RuntimeError(f"tp ranks hold different numbers of optimizer states {counts}; cannot merge them")
    shard = _Shard(kind)
    for i, key in enumerate(sorted(keyed)):
        tensor, axis = keyed[key]
        entry = _Entry(key, tensor, axis, topo.dp_rank == 0, topo.dp_rank == 0 and topo.tp_rank == i % tp)
        shard.entries.append(entry)
        if entry.mine:
            dtype = np.dtype(str(tensor.dtype).removeprefix("paddle."))
            shard.specs.append(TensorSpec(key, dtype, tuple(single_card_shape(tensor.shape, axis, tp))))
    return shard


def _assembled(shard: _Shard, topo: Topology, cast: str | None, borrow: bool) -> Iterator[np.ndarray]:
    """Drive every gather of the shard's entries in order; yield the tensors this rank writes
    (views of live tensors where `borrow` allows, see `replicas.host_array`)."""
    for entry in shard.entries:
        if not entry.gather:
            continue
        local = entry.local.detach()
        if entry.axis is not None and topo.layout.tp > 1:
            parts: list = []
            dist.all_gather(parts, local, group=topo.tp_group)
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
        failed = gather_objects(bool(self.error), None, self.topo.layout.world_size)
        if any(failed):
            raise RuntimeError(f"writing checkpoint-{self.step} failed on ranks "
                               f"{[r for r, f in enumerate(failed) if f]}: {self.error}")
        everyone = gather_objects(self.results, None, self.topo.layout.world_size)
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
    adds a gradients kind, for alignment checks. `replica_check` (see `replicas.check_replicas`)
    runs first: a failed check leaves nothing behind."""
    output_dir = Path(output_dir)
    state = model.state_dict()
    check_replicas(state, axes, topo, replica_check)
    if topo.global_rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        commits.clear_stale_temp(output_dir, step)
        commits.temp_dir(output_dir, step).mkdir()
    gather_objects(None, None, topo.layout.world_size)  # the folder exists before anyone writes
    owned = _owned_names(state, topo)  # one pipeline all-gather serves both shards
    shards = [_model_shard(state, owned, axes, topo)]
    if optimizer is not None:
        shards.append(_per_parameter_shard(OPTIMIZER, state, owned, states_by_parameter(optimizer), axes, topo))
    if gradients is not None:
        shards.append(_per_parameter_shard(GRADIENTS, state, owned, gradients, axes, topo))
    counts = gather_objects({s.kind: bool(s.specs) for s in shards}, None, topo.layout.world_size)
    plans = {}
    for shard in shards:
        writers = [rank for rank, c in enumerate(counts) if c.get(shard.kind)]
        if shard.specs:
            plans[shard.kind] = (shard_name(shard.kind, writers.index(topo.global_rank) + 1, len(writers)), shard)
        else:
            plans[shard.kind] = (None, shard)
    layout_info = topo.layout.record()
    extra = {"json_files": {CONFIG_FILE: single_card_config(config),
                            TRAINER_STATE_FILE: {"format_version": FORMAT_VERSION, "saving_layout": layout_info,
                                                 **trainer_state}},
             "copy_files": [str(path) for path in extra_files],
             "model_metadata": model_metadata(config)}
    pending = PendingSave(output_dir, step, topo, layout_info, plans, extra, keep)
    staged = commits.temp_dir(output_dir, step)

    def write(kind: str, fname: str | None, shard: _Shard, arrays) -> None:
        if fname is None:
            for _ in arrays:
                pass
            return
        entry = write_shard(staged / fname, shard.specs, arrays, {"format": "np"})
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

