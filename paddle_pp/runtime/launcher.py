"""`python -m paddle_pp.runtime.launcher [paddle.distributed.launch's flags] script ...`: Paddle's own
launcher (`paddle.distributed.launch.main.launch`: its flags, controllers, pods, master and multi-node
rendezvous unchanged) with one internal replaced: its pod looks for its ranks' exit every
`EXIT_POLL_S` instead of every second (`Pod.watch`'s `interval=1`), so a job ends when its ranks do,
not up to a second later (measured: 1.1 s of a 3.7 s 4-rank no-op launch; docs/benchmarks.md, "A
launch's fixed time"). `runtime/launch.py` starts the multi-process jobs of tests and tools through
it; users run either, with the same flags.
"""

from __future__ import annotations

import functools

EXIT_POLL_S = 0.05  # 20 status checks of a few processes a second: nothing next to a rank's work


def poll_exits_often() -> None:
    """Have Paddle's pods check their ranks every `EXIT_POLL_S` (upstream: `Pod.watch(interval=1)`,
    called by the controller's watch loop as `pod.watch(timeout=2)`)."""
    from paddle.distributed.launch.job.pod import Pod

    Pod.watch = functools.partialmethod(Pod.watch, interval=EXIT_POLL_S)


if __name__ == "__main__":
    poll_exits_often()
    from paddle.distributed.launch.main import launch

    launch()
