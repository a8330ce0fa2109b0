"""Making a save durable and atomic, finding the newest complete one, and rotating old ones.

A save is written into a hidden temporary folder; once every file is fsynced, the folder is
renamed to `checkpoint-<step>` (atomic on POSIX), the parent folder is fsynced, and only then does
the `latest` marker (itself replaced atomically) name it. A crash at any point leaves either the
old checkpoint as latest or the new one complete; a temporary folder is never mistaken for one.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

from checkpoint.durable import fsync_dir, fsync_file
from checkpoint.format import CHECKPOINT_PREFIX, LATEST_FILE, CheckpointError, checkpoint_dir_name

TEMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"  # a committed folder moved aside while a re-save of its step takes its name
STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def temp_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / f"{TEMP_PREFIX}{checkpoint_dir_name(step)}"


def commit(output_dir: Path, step: int) -> Path:
    """Rename the fully written temporary folder into place and point `latest` at it, unless
    `latest` names a newer step: it only ever moves forward, so a stray writer of an older step
    (a job restarted from an earlier checkpoint while another still runs) cannot move it back."""
    output_dir = Path(output_dir)
    staged, final = temp_dir(output_dir, step), output_dir / checkpoint_dir_name(step)
    fsync_dir(staged)
    retired = output_dir / f"{REPLACED_PREFIX}{final.name}"
    if final.exists():  # a re-save of the same step: the old copy stays whole until the new one is in place
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
    os.replace(staged, final)
    fsync_dir(output_dir)
    if retired.exists():
        shutil.rmtree(retired)
    named = latest_step(output_dir)
    if named is None or step >= named:
        marker = output_dir / f".{LATEST_FILE}.tmp"
        marker.write_text(final.name + "\n")
        fsync_file(marker)
        os.replace(marker, output_dir / LATEST_FILE)
        fsync_dir(output_dir)
    return final


def latest_step(output_dir: Path) -> int | None:
    """The step `latest` names, or None when there is no readable marker."""
    marker = Path(output_dir) / LATEST_FILE
    match = STEP_DIR.match(marker.read_text().strip()) if marker.is_file() else None
    return int(match.group(1)) if match else None


def committed_steps(output_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in Path(output_dir).iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def unclaimed_checkpoints(output_dir: Path) -> list[str]:
    """`checkpoint-<step>` folders in `output_dir` when no `latest` marker claims the folder as ours
    (PaddleNLP's or PaddleFormers' runs write such names): a save of the same step would replace one."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir() or (output_dir / LATEST_FILE).is_file():
        return []
    return [checkpoint_dir_name(step) for step in committed_steps(output_dir)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint `latest` names, warning about any save that never committed."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    for stale in output_dir.glob(f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}*"):
        warnings.warn(f"ignoring {stale}: a save that never committed (the process stopped while writing it)",
                      stacklevel=2)
    marker = output_dir / LATEST_FILE
    if not marker.is_file():
        return None
    folder = output_dir / marker.read_text().strip()
    if not folder.is_dir():
        raise CheckpointError(f"{marker} names {folder.name}, which does not exist")
    return folder


def rotate(output_dir: Path, keep: int) -> list[Path]:
    """Delete the oldest committed checkpoints beyond `keep`, never the one `latest` names."""
    if keep <= 0:
        return []
    latest = latest_checkpoint(output_dir)
    removed = []
    for step in committed_steps(output_dir)[:-keep]:
        folder = Path(output_dir) / checkpoint_dir_name(step)
        if latest is not None and folder.resolve() == latest.resolve():
            continue
        shutil.rmtree(folder)
        removed.append(folder)
    return removed


def clear_interrupted_saves(output_dir: Path) -> list[str]:
    """What killed jobs left: folders of saves that never committed (deleted: each can be as large
    as a checkpoint, and nothing reads them), and a committed folder moved aside by a re-save cut
    between its two renames (put back when the new copy never arrived). Only the job holding the
    output_dir lock calls this, before it saves anything. Returns the names it removed or restored."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    cleared = []
    for stale in sorted(output_dir.glob(f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}*")):
        shutil.rmtree(stale)
        cleared.append(stale.name)
    for retired in sorted(output_dir.glob(f"{REPLACED_PREFIX}{CHECKPOINT_PREFIX}*")):
        final = output_dir / retired.name[len(REPLACED_PREFIX):]
        if final.exists():
            shutil.rmtree(retired)
        else:
            os.replace(retired, final)
        cleared.append(retired.name)
    if cleared:
        fsync_dir(output_dir)
    return cleared


def clear_stale_temp(output_dir: Path, step: int) -> None:
    """Remove a leftover temporary folder of the same step from a crashed earlier attempt."""
    staged = temp_dir(output_dir, step)
    if staged.exists():
        shutil.rmtree(staged)
