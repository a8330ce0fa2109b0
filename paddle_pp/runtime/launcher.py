"""`python -m paddle_pp.runtime.launcher [paddle.distributed.launch's flags] script ...`: Paddle's own
launcher (`paddle.distributed.launch.main.launch`: its flags, controllers, pods, master and multi-node
rendezvous unchanged) with one internal replaced, its pod's watch (`Pod.watch`):

- it looks for its ranks' exit every `EXIT_POLL_S` instead of every second (`interval=1`), so a job
  ends when its ranks do, not up to a second later (measured: 1.1 s of a 3.7 s 4-rank no-op launch;
  docs/benchmarks.md, "A launch's fixed time");
- when a rank fails, the others get up to `SIBLING_GRACE_S` to end on their own before the controller
  stops them. Upstream's one-second poll gave them anywhere between 0 and 1 s; a refusal every rank
  makes by itself (a bad flag, a hostile folder, a corrupt checkpoint) is then in every rank's log
  instead of only the fastest one's. A rank that hangs waiting for the failed one is stopped after the
  grace, as upstream stops it.

`runtime/launch.py` starts the multi-process jobs of tests and tools through it; users run either,
with the same flags.
"""

from __future__ import annotations

import time

EXIT_POLL_S = 0.05  # 20 status checks of a few processes a second: nothing next to a rank's work
SIBLING_GRACE_S = 5.0


def watch_often(pod, all_list=None, any_list=None, interval: float = EXIT_POLL_S, timeout: float = -1):
    """Upstream's `Pod.watch` (return when any container is in `any_list`, default failed, or all are in
    `all_list`, default completed; None after `timeout`) polling every `EXIT_POLL_S`, with the siblings'
    grace after a failure."""
    from paddle.distributed.launch.job.status import Status

    all_list = all_list or [Status.COMPLETED]
    any_list = any_list or [Status.FAILED]
    containers = pod._init_containers + pod._containers
    end = time.time() + timeout
    while timeout < 0 or time.time() < end:
        failed = next((c.status for c in containers if c.status in any_list), None)
        if failed is not None:
            _grace(containers, Status.RUNNING)
            return failed
        statuses = {c.status for c in containers}
        if len(statuses) == 1 and statuses <= set(all_list):
            return statuses.pop()
        time.sleep(interval)
    return None


def _grace(containers, running) -> None:
    """Wait up to `SIBLING_GRACE_S` for every container still running to end by itself."""
    end = time.time() + SIBLING_GRACE_S
    while time.time() < end and any(c.status == running for c in containers):
        time.sleep(EXIT_POLL_S)


def install() -> None:
    """Replace `Pod.watch` (upstream: polls every second, called by the controller's watch loop as
    `pod.watch(timeout=2)`; stops the pod as soon as it returns a failure)."""
    from paddle.distributed.launch.job.pod import Pod

    Pod.watch = watch_often


if __name__ == "__main__":
    install()
    from paddle.distributed.launch.main import launch

    launch()
