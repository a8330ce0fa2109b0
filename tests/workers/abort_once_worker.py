"""The last rank dies of SIGABRT without a word on the first attempt (marker file absent), as the rare
gloo crash does; every later attempt succeeds. `--raise` fails with a Python error instead."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from paddle_pp.runtime.launch import write_result

marker, rank = Path(sys.argv[1]), int(os.environ.get("PADDLE_TRAINER_ID", "0"))
last = int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) - 1
if "--raise" in sys.argv:
    raise RuntimeError("a real bug")
if rank == last and not marker.exists():
    marker.touch()
    os.abort()
write_result({"rank": rank})
