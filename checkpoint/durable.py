"""Writes that survive a crash: fsync of files and folders, JSON written durably, and files and
folders that appear under their final name only once complete."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from checkpoint.format import CheckpointError


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    fsync_file(path)


@contextmanager
def replaced_when_written(target: Path) -> Iterator[Path]:
    """A hidden sibling path to write; once the block ends it is fsynced and renamed to `target`
    (several processes may write the same target: each has its own sibling, the last rename wins).
    An exception removes the sibling and leaves `target` as it was."""
    target = Path(target)
    staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield staged
        fsync_file(staged)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)


@contextmanager
def new_folder(target: Path) -> Iterator[Path]:
    """A folder written as `<target>.partial` and renamed to `target` only once complete, so an
    interrupted tool never leaves a folder that looks whole."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"{target} exists; choose a new folder")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    fsync_dir(partial)
    os.replace(partial, target)
    fsync_dir(target.parent)
