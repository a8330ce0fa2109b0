"""run_pretrain.py (its `main`) whose process SIGKILLs itself in the middle of its second checkpoint save.

The first shard of the second save is written, then the process dies before the save commits:
exactly a node lost mid-save. Fault injection wraps the shard writer; nothing in the library knows.
"""

from __future__ import annotations

import os
import signal
import sys

import checkpoint.save as save
from paddle_pp.training import cli

calls = {"count": 0}
write_shard = save.write_shard


def write_then_die(*args, **kwargs):
    result = write_shard(*args, **kwargs)
    calls["count"] += 1
    if calls["count"] == 3:  # save 1 wrote model + optimizer shards; save 2 dies after its model shard
        os.kill(os.getpid(), signal.SIGKILL)
    return result


save.write_shard = write_then_die
sys.exit(cli.main(sys.argv[1:]))
