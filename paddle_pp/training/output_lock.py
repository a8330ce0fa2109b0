"""One writer per output_dir: a running job holds `output_dir/.run.lock` (host, pid, process start
time); a second job refuses to start, naming the owner, and the lock of a dead owner is taken over.

Two jobs training into one folder interleave their checkpoints and metrics (seen when a killed
launcher's ranks trained on as orphans while the restarted job ran). Rank 0 takes the lock before
any process group exists, so the refusal costs no collective; the launcher then stops its peers.
An owner on another host cannot be checked from here: it is treated as alive, and the message says
how to clear its lock once that job is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from paddle_pp.runtime.errors import UserError

LOCK_FILE = ".run.lock"
WRITE_GRACE_S = 2.0


class OutputDirInUseError(UserError, RuntimeError):
    """Another live job writes into this output_dir."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: int  # the process's start time in clock ticks since boot (/proc/<pid>/stat), against pid reuse

    @classmethod
    def this_process(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), _start_time(os.getpid()))

    def alive(self) -> bool:
        """True unless this host can tell the owner is gone (no such process, or a reused pid)."""
        if self.host != socket.gethostname():
            return True
        return _start_time(self.pid) == self.started


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _read(path: Path) -> Owner | None:
    """The owner a lock names; None for a lock being written (empty) or torn by a kill."""
    try:
        return Owner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _settled_owner(path: Path) -> Owner | None:
    """The lock's owner, waiting out a starter between creating the lock and writing it (a few
    microseconds) for up to WRITE_GRACE_S; an owner still unreadable after that died mid-write."""
    deadline = time.monotonic() + WRITE_GRACE_S
    while (owner := _read(path)) is None and path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return owner


def acquire(output_dir: Path) -> Path:
    """Take output_dir's lock for this process, taking over the lock of a dead owner."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path, me = output_dir / LOCK_FILE, Owner.this_process()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _settled_owner(path)
            if owner == me:
                return path
            if owner is not None and owner.alive():
                raise OutputDirInUseError(
                    f"{output_dir} is in use by another job (host {owner.host}, pid {owner.pid}); stop that job or "
                    f"choose another --output_dir. If that job is gone, delete {path}") from None
            _take_over(path, owner)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(asdict(me)))
            handle.flush()
            os.fsync(handle.fileno())
        return path


def _take_over(path: Path, stale: Owner | None) -> None:
    """Move a dead owner's lock aside. Two starters may both judge it stale: the rename is atomic,
    so only one moves it; a starter that moved a lock other than the one it judged (a newer owner's)
    puts it back and looks again."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != stale:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink()


def release(path: Path) -> None:
    """Drop the lock at the end of a run, if this process still holds it."""
    if _read(path) == Owner.this_process():
        path.unlink()
