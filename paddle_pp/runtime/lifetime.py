"""A rank never outlives the launcher that started it.

`paddle.distributed.launch` starts each rank in a session of its own (`os.setsid`), so when a
scheduler or the OOM killer SIGKILLs the launcher, nothing reaches the ranks: they train on as
orphans, into the same output_dir as the job restarted after them. Linux delivers a chosen signal
to a process when its parent dies (`prctl(PR_SET_PDEATHSIG)`); a launched rank asks for SIGKILL.
Only the standard library is imported here, so an entry point can call this before its heavy
imports and the window in which the launcher could die unnoticed stays a few milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHED_ENV = "PADDLE_TRAINER_ID"  # set by paddle.distributed.launch for every rank it starts


def die_with_launcher() -> bool:
    """Under `paddle.distributed.launch` on Linux, have this process SIGKILLed when its launcher
    dies, and exit now if the launcher died while the guard was being set (the parent changed).
    Returns whether the guard is in place (False: not launched, or not Linux). The interpreter's
    own start-up, before this call, is the one window a launcher's death can go unnoticed."""
    if LAUNCHED_ENV not in os.environ or not sys.platform.startswith("linux"):
        return False
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:
        os._exit(1)
    return True
