"""run_pretrain.py (its `main`) whose processes SIGKILL themselves in the middle of their second
checkpoint save.

A rank writes its first shard of the second save, then dies before the save commits: exactly a node
lost mid-save (under a launch, the launcher then ends the other ranks). Fault injection wraps the
shard stream; nothing in the library knows.
"""

from __future__ import annotations

import os
import signal
import sys

import checkpoint.save as save
from paddle_pp.training import cli

saves_seen: list[str] = []


class WriteThenDie(save.ShardStream):
    def finish(self) -> dict:
        result = super().finish()
        if self.path.parent.name not in saves_seen:
            saves_seen.append(self.path.parent.name)
        if len(saves_seen) == 2:  # the first shard this rank writes into its second save
            os.kill(os.getpid(), signal.SIGKILL)
        return result


save.ShardStream = WriteThenDie
sys.exit(cli.main(sys.argv[1:]))
