"""run_pretrain.py's entry point on rank 0 of a launch of N ranks that never starts the other N - 1:
for each request of a JSON file ([world size, argv]), the environment `paddle.distributed.launch`
gives rank 0, then the trainer's `main`. A request refused before any process group returns exit
code 2 at once with its one-line message; one that reached a collective would wait for ranks that
never come, and the caller's timeout fails. Prints [exit code, message] per request as JSON."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def main() -> None:
    from paddle_pp.runtime.launch import free_port
    from paddle_pp.training.cli import main as run_pretrain

    out = []
    for world_size, argv in json.loads(open(sys.argv[1]).read()):
        endpoints = [f"127.0.0.1:{free_port()}" for _ in range(world_size)]
        os.environ.update(PADDLE_TRAINERS_NUM=str(world_size), PADDLE_TRAINER_ID="0", PADDLE_LOCAL_SIZE=str(world_size),
                          PADDLE_RANK_IN_NODE="0", PADDLE_LOCAL_RANK="0", PADDLE_MASTER=endpoints[0],
                          PADDLE_CURRENT_ENDPOINT=endpoints[0], PADDLE_TRAINER_ENDPOINTS=",".join(endpoints))
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            code = run_pretrain(argv)
        errors = [line for line in printed.getvalue().splitlines() if line.startswith("run_pretrain.py: error: ")]
        out.append([code, errors[-1].removeprefix("run_pretrain.py: error: ") if errors else ""])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
