"""Loading a unified checkpoint under any layout (or a pre-split copy under its own layout): each
rank reads only its own slices.

A parameter's TP slice is read out of the single-card tensor in the shard (positioned reads), so no
rank keeps more than it holds. Optimizer states are created first (Paddle makes them lazily) and
filled for the parameters this rank updates under the *new* sharding degree, which re-partitions
them. Every name and shape is checked on every rank before any byte is read. Each file is then
checked against the checksum in the index by exactly one of the ranks that read it (see
`checking_ranks`), before the load returns; a mismatch fails the load on every rank (and so the
run) before any training step.
"""

from __future__ import annotations

import ctypes
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import paddle

from checkpoint.format import (
    CONFIG_FILE,
    MODEL,
    OPTIMIZER,
    STATE_SEPARATOR,
    TRAINER_STATE_FILE,
    CheckpointError,
    index_name,
    read_index,
    require_our_layout,
)
from checkpoint.optimizer_state import MASTER_WEIGHT, ensure_states, state_tp_axis, states_by_parameter
from checkpoint.piece import Piece
from checkpoint.shards import ShardReader, recorded_checksum
from checkpoint.split import check_split_layout, is_split, rank_key, read_split_index
from checkpoint.stage3 import FlatSlice, as_saved, held_piece
from paddle_pp.runtime.layout import Layout
from paddle_pp.runtime.stage3 import slice_param_name
from paddle_pp.runtime.topology import Topology, gather_objects

ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                       "tie_word_embeddings", "lora")  # a LoRA run's adapters are tensors of its checkpoint


def check_compatible(folder: Path, config, layout: Layout, saved: dict | None = None) -> None:
    """Before any process group exists: the folder is a complete checkpoint of this architecture
    (and, when pre-split, split for this layout). `saved`: the checkpoint's config as ours (default:
    its config.json, which is ours unless its weights are in transformers' layout)."""
    folder = Path(folder)
    if is_split(folder):
        check_split_layout(folder, layout)
    else:
        read_index(folder, MODEL)
    if not (folder / TRAINER_STATE_FILE).is_file():
        raise CheckpointError(f"{folder / TRAINER_STATE_FILE} is missing: not a complete training checkpoint")
    saved = saved if saved is not None else json.loads((folder / CONFIG_FILE).read_text())
    ours = config.to_dict()
    for name in ARCHITECTURE_FIELDS:
        if name in saved or name in ours:
            if saved.get(name) != ours.get(name):
                raise CheckpointError(f"checkpoint {folder} is from another model: {name} is {saved.get(name)!r} "
                                      f"there and {ours.get(name)!r} here; resume with the checkpoint's model flags "
                                      "or start a new output_dir")


class _VerifiedFiles:
    """The tensors this rank needs, gathered per file by `want`, then read by `load`. A file this
    rank checks is read once, front to back, its checksum computed on a helper thread from the same
    bytes (the checksum needs every byte anyway); from any other file only the wanted pieces are read."""

    def __init__(self, folder: Path, meta: dict):
        self.folder, self.meta = folder, meta
        self.readers: dict[str, ShardReader] = {}
        self.wanted: dict[str, dict[str, tuple[Piece, list[tuple[Piece, paddle.Tensor | FlatSlice]]]]] = {}

    def open(self, fname: str) -> ShardReader:
        if fname not in self.readers:
            path = self.folder / fname
            expected = self.meta["files"][fname]
            if not path.is_file():
                raise CheckpointError(f"{path} is missing from the checkpoint")
            if path.stat().st_size != expected["size"]:
                raise CheckpointError(f"{path} is {path.stat().st_size} bytes, the index says {expected['size']}: "
                                      "the file is truncated; restore it or resume from an older checkpoint")
            self.readers[fname] = ShardReader(path)
        return self.readers[fname]

    def want(self, fname: str, name: str, piece: Piece, target: paddle.Tensor | FlatSlice) -> None:
        """Read tensor `name`'s `piece` into `target`. One tensor can fill several targets (a
        parameter and its master weight, one of them a stage3 slice): its TP piece is read once,
        each target's slice cut from it."""
        self.open(fname)
        self.wanted.setdefault(fname, {}).setdefault(name, (piece.tp_piece, []))[1].append((piece, target))

    def sizes(self) -> dict[str, int]:
        """Bytes of each file this rank reads from."""
        return {fname: self.meta["files"][fname]["size"] for fname in self.wanted}

    def load(self, checked: set[str], hasher: ThreadPoolExecutor) -> None:
        for fname, wanted in self.wanted.items():
            reader, check = self.readers[fname], fname in checked
            algorithm, expected = recorded_checksum(self.meta["files"][fname])
            into = {name: view for name, (_, targets) in wanted.items()
                    if len(targets) == 1 and (view := _writable_view(targets[0][1])) is not None}
            digest = reader.scan({name: piece for name, (piece, _) in wanted.items()},
                                 lambda name, array: [set_parameter(target, piece.flat_slice(array))
                                                      for piece, target in wanted[name][1]],
                                 hasher if check else None, algorithm, into)
            if check and digest != expected:
                raise CheckpointError(f"{reader.path} fails its {algorithm} checksum: the file is corrupted; restore it "
                                      "or resume from an older checkpoint")


def checking_ranks(sizes_by_rank: list[dict[str, int]]) -> dict[str, int]:
    """The one rank that checks each file's checksum, among the ranks that read from it.

    The TP ranks of a stage, and every data replica, read the same files; if each checked every
    file it reads, each would read all of them whole and sum every byte (0.74x of bare safetensors
    in a tp2 pp2 load). Checking each file once across the job is as safe, since a mismatch fails
    every rank. Files go largest first to the reading rank with the fewest bytes to check so far,
    so the checking is spread evenly."""
    readers: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, files in enumerate(sizes_by_rank):
        for fname, size in files.items():
            readers.setdefault(fname, []).append(rank)
            sizes[fname] = size
    assigned = [0] * len(sizes_by_rank)
    checker = {}
    for fname in sorted(sizes, key=lambda f: (-sizes[f], f)):
        checker[fname] = min(readers[fname], key=lambda rank: (assigned[rank], rank))
        assigned[checker[fname]] += sizes[fname]
    return checker


class _UnifiedFiles(_VerifiedFiles):
    """A unified checkpoint: this rank's TP piece is cut out of each single-card tensor."""

    def __init__(self, folder: Path, kind: str):
        self.index = read_index(folder, kind)
        require_our_layout(self.index, folder)
        super().__init__(folder, self.index["metadata"])

    def want_local(self, name: str, local_shape: list[int], piece: Piece, target: paddle.Tensor | FlatSlice) -> None:
        full = piece.full_shape(local_shape)
        saved = self.meta["tensors"].get(name, {}).get("shape")
        if name not in self.index["weight_map"]:
            raise CheckpointError(f"checkpoint {self.folder} has no tensor {name!r}: it was saved from a different "
                                  f"model ({self.meta.get('model_type', 'unknown type')})")
        if saved != full:
            raise CheckpointError(f"{name}: the checkpoint holds shape {saved}, this model needs {full} (single-card "
                                  f"shapes); it was saved from a different model configuration")
        self.want(self.index["weight_map"][name], name, piece, target)

    def holds(self, name: str) -> bool:
        return name in self.index["weight_map"]


class _SplitFiles(_VerifiedFiles):
    """A pre-split checkpoint: this rank's one file holds its tensors whole."""

    def __init__(self, folder: Path, kind: str, topo: Topology):
        index = read_split_index(folder)
        super().__init__(folder, index["metadata"])
        self.fname = index["ranks"].get(rank_key(topo.tp_rank, topo.pp_rank), {}).get(kind)
        if self.fname is None:
            raise CheckpointError(f"{folder} has no {kind} file for tp rank {topo.tp_rank}, stage {topo.pp_rank}")

    def want_local(self, name: str, local_shape: list[int], piece: Piece, target: paddle.Tensor | FlatSlice) -> None:
        reader = self.open(self.fname)
        if name not in reader.names:
            raise CheckpointError(f"{reader.path} has no tensor {name!r}: the split copy is of another model or "
                                  "another layout")
        if reader.shape(name) != list(local_shape):
            raise CheckpointError(f"{name}: {reader.path} holds shape {reader.shape(name)}, this rank needs "
                                  f"{list(local_shape)}")
        self.want(self.fname, name, piece.in_tp_piece, target)

    def holds(self, name: str) -> bool:
        return name in self.open(self.fname).names


def _files(folder: Path, kind: str, topo: Topology) -> _VerifiedFiles:
    if is_split(folder):
        return _SplitFiles(folder, kind, topo)
    return _UnifiedFiles(folder, kind)


def _has_kind(folder: Path, kind: str) -> bool:
    if is_split(folder):
        return kind in read_split_index(folder)["tensors"]
    return (folder / index_name(kind)).is_file()


def set_parameter(target: paddle.Tensor | FlatSlice, array: np.ndarray) -> None:
    """Set `target` from `array`, its part as read (a `FlatSlice` from its flat slice)."""
    if isinstance(target, FlatSlice):
        target.assign(array)
        return
    target.set_value(array.reshape(target.shape).astype(str(target.dtype).removeprefix("paddle."), copy=False))


def _writable_view(target: paddle.Tensor) -> np.ndarray | None:
    """A CPU tensor's own memory as a writable array, so a tensor (or its TP piece) is read from the
    file straight into it: reading into a buffer and then `set_value` copies every byte once more (0.46 s of a
    4.5 s load of 2 GB). numpy marks DLPack views read-only, so the writable view is built from the
    view's address; it is used while `target` is alive (the load holds it). None where the tensor
    is not contiguous host memory numpy can type (a GPU tensor, bfloat16, empty, strided)."""
    if isinstance(target, FlatSlice) or not target.place.is_cpu_place() or target.dtype == paddle.bfloat16 \
            or target.size == 0:
        return None
    view = np.from_dlpack(target.detach())
    if not view.flags.c_contiguous:
        return None
    memory = (ctypes.c_char * view.nbytes).from_address(view.ctypes.data)
    return np.frombuffer(memory, view.dtype).reshape(view.shape)


def _master_of(name: str) -> str:
    return f"{name}{STATE_SEPARATOR}{MASTER_WEIGHT}"


def _want_model(weights: _VerifiedFiles, states: _VerifiedFiles | None, model, axes: dict, topo: Topology) -> None:
    """Each parameter from its fp32 master weight where a mixed-precision run saved one (the bf16
    weights are that master rounded), else from the weights themselves; so a bf16 checkpoint
    resumed in fp32 goes on from the masters, as PaddleNLP's `master_weight_compatible` does."""
    for name, param in model.state_dict().items():
        piece = held_piece(param, axes.get(name), topo)
        if states is not None and states.holds(_master_of(name)):
            states.want_local(_master_of(name), list(param.shape), piece, param)
        else:
            weights.want_local(name, list(param.shape), piece, param)


def _want_optimizer(states: _VerifiedFiles, weights: Callable[[], _VerifiedFiles], model, optimizer, axes: dict,
                    topo: Topology) -> None:
    """Every state this rank's optimizer holds; a master weight the checkpoint lacks (it was saved
    in fp32) comes from the saved fp32 weights, not from the bf16 parameter it was made from."""
    ensure_states(optimizer)
    by_param = states_by_parameter(optimizer)
    for name, param in model.state_dict().items():
        for state_name, tensor in by_param.get(slice_param_name(param), {}).items():
            target = as_saved(param, tensor, topo)
            source, saved = states, f"{name}{STATE_SEPARATOR}{state_name}"
            if state_name == MASTER_WEIGHT and not states.holds(saved):
                source, saved = weights(), name
            piece = held_piece(target, state_tp_axis(target.shape, param.shape, axes.get(name)), topo)
            source.want_local(saved, list(target.shape), piece, target)


def load_checkpoint(folder: Path, model, optimizer, topo: Topology, axes: dict, verify: bool = True,
                    weights: bool = True) -> dict:
    """Fill `model` (unless not `weights`) and `optimizer` (when given and saved) from `folder`;
    returns the trainer state ({} for a weights-only folder). The trainer loads weights into the
    model before the layout's wrappers take it (stage3 slices what it finds there) and the
    optimizer's states after (the wrapped optimizer knows which states this rank holds). Either
    precision resumes the other's checkpoint (`_want_model`, `_want_optimizer`).

    A failure on any rank is raised on every rank (after an all-gather of the outcome), so no rank
    walks on into a collective that the failed one will never join: once after the names and
    shapes are checked, before any byte is read, and once after the reads and checksums."""
    folder = Path(folder)
    files: dict[str, _VerifiedFiles] = {}

    def kind_files(kind: str) -> _VerifiedFiles:
        if kind not in files:
            files[kind] = _files(folder, kind, topo)
        return files[kind]

    outcome: CheckpointError | dict[str, int] | None
    try:
        states = kind_files(OPTIMIZER) if _has_kind(folder, OPTIMIZER) else None
        if weights:
            _want_model(kind_files(MODEL), states, model, axes, topo)
        if optimizer is not None and states is not None:
            _want_optimizer(states, lambda: kind_files(MODEL), model, optimizer, axes, topo)
        outcome = {fname: size for kind in files.values() for fname, size in kind.sizes().items()}
    except LOAD_ERRORS as err:
        outcome = checkpoint_error(err)
    sizes_by_rank = agree_on_outcome(outcome, folder, topo)
    mine = {f for f, rank in checking_ranks(sizes_by_rank).items() if rank == topo.global_rank} if verify else set()
    try:
        with ThreadPoolExecutor(max_workers=1) as hasher:
            for kind in files.values():
                kind.load(mine, hasher)
        outcome = None
    except LOAD_ERRORS as err:
        outcome = checkpoint_error(err)
    agree_on_outcome(outcome, folder, topo)
    state_file = folder / TRAINER_STATE_FILE
    return json.loads(state_file.read_text()) if state_file.is_file() else {}


LOAD_ERRORS = (CheckpointError, OSError, ValueError)


def checkpoint_error(err: Exception) -> CheckpointError:
    return err if isinstance(err, CheckpointError) else CheckpointError(str(err))


def agree_on_outcome(outcome: CheckpointError | dict[str, int] | None, folder: Path, topo: Topology) -> list:
    """Every rank's outcome; raises on every rank when any rank's is an error (its own first)."""
    outcomes = gather_objects(str(outcome) if isinstance(outcome, Exception) else outcome, None,
                              topo.layout.world_size)
    if isinstance(outcome, Exception):
        raise outcome
    failures = [(rank, msg) for rank, msg in enumerate(outcomes) if isinstance(msg, str)]
    if failures:
        raise CheckpointError(f"loading {folder} failed on rank {failures[0][0]}: {failures[0][1]}")
    return outcomes
