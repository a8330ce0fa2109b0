"""The pipeline schedules of Paddle 3.3.1's fleet: which one a run takes, what each needs of the
micro-batches and the model, and what each keeps in flight and leaves idle, from its own order.

Fleet picks the class (`fleet.distributed_model`): `PipelineParallel` (1F1B) with one chunk per
stage; with virtual stages `PipelineParallelWithInterleave` (VPP) from 2 x pp micro-batches and
`PipelineParallelWithInterleaveFthenB` (FThenB: every forward, then every backward) from pp to
2 x pp; `DualPipeVParallel` when `pp_configs.use_dualpipev` is set (DeepSeek's DualPipeV: two
chunks per stage in a V, `Layout.dualpipev`). The counts below are read off those classes' loops:
`bench/pipeline_schedules.py` replays the order each class runs on every stage and checks them.
"""

from __future__ import annotations

from paddle_pp.runtime.errors import UserError
from paddle_pp.runtime.layout import Layout


class ScheduleError(UserError, ValueError):
    """A pipeline schedule the run's micro-batches or model cannot take."""


def resolve_schedule(layout: Layout, accumulate_steps: int) -> str:
    """The schedule fleet runs for this layout and micro-batch count ("" without a pipeline); an
    explicit `--pipeline_schedule` that fleet would not pick for these micro-batches is refused."""
    if layout.pp == 1:
        return ""
    if layout.dualpipev:
        if accumulate_steps < 2 * layout.pp:
            raise ScheduleError(
                f"--pipeline_schedule DualPipeV needs at least 2 x --pipeline_parallel_degree = {2 * layout.pp} "
                f"micro-batches per step (its V fills both chunks of every stage first); got {accumulate_steps}: "
                "raise --gradient_accumulation_steps")
        return "DualPipeV"
    if layout.vpp == 1:
        return "1F1B"
    if accumulate_steps < layout.pp:
        raise ScheduleError(
            f"--virtual_pp_degree needs at least --pipeline_parallel_degree {layout.pp} micro-batches per step; got "
            f"{accumulate_steps} (raise --gradient_accumulation_steps)")
    picked = "VPP" if accumulate_steps >= 2 * layout.pp else "FThenB"
    if layout.pipeline_schedule in ("VPP", "FThenB") and layout.pipeline_schedule != picked:
        need = (f"at least 2 x --pipeline_parallel_degree = {2 * layout.pp}" if layout.pipeline_schedule == "VPP"
                else f"--pipeline_parallel_degree = {layout.pp}")
        raise ScheduleError(
            f"--pipeline_schedule {layout.pipeline_schedule} runs with {need} micro-batches per step (fleet picks "
            f"the interleaved class by their count); got {accumulate_steps}: change --gradient_accumulation_steps, "
            f"or use --pipeline_schedule {picked}")
    if picked == "FThenB" and accumulate_steps != layout.pp:
        raise ScheduleError(
            f"--virtual_pp_degree {layout.vpp} with {accumulate_steps} micro-batches per step: fleet runs FThenB below "
            f"2 x --pipeline_parallel_degree = {2 * layout.pp} micro-batches, and FThenB asserts a multiple of "
            f"--pipeline_parallel_degree {layout.pp}; use {layout.pp} or at least {2 * layout.pp} (VPP)")
    return picked


def check_schedule_model(schedule: str, config) -> None:
    """What DualPipeV's V cannot hold: a tied embedding (the embedding and the head are both on the
    first stage, where fleet's `LocalSharedLayerDesc` would share them; not wired here, and fleet's
    `SharedLayerDesc` is refused under DualPipeV)."""
    if schedule == "DualPipeV" and config.tie_word_embeddings:
        raise ScheduleError(
            "--pipeline_schedule DualPipeV with tie_word_embeddings=true: the tied embedding and head would share "
            "one weight on the first stage, which is not wired here (fleet refuses its SharedLayerDesc under "
            "DualPipeV); use --pipeline_schedule 1F1B, or a model with an untied head")


def in_flight(schedule: str, pp: int, vpp: int, stage: int, micro_batches: int) -> float:
    """How many micro-batches of a whole stage's layers have activations alive on `stage` at its peak
    (a chunk's forward done, its backward not), counting a chunk as its share of the stage.

    Read off the classes' loops: 1F1B warms up with pp - stage - 1 forwards, then alternates, so
    min(pp - stage, m) are alive; FThenB runs every forward first: m. VPP warms up with
    2 (pp - stage - 1) + (vpp - 1) (m % pp + pp) chunk forwards (fleet's `startup_steps`), then
    alternates: one more than those, over vpp. DualPipeV holds 2 pp + 1 half-stage chunks from its
    main loop on (2 (pp - stage - 1) + stage + 1 forwards of the first arm and stage + 1 of the second
    after its fill, then a forward before each backward): (2 pp + 1) / 2. `bench/pipeline_bubble.py`
    counts them in the orders the classes run."""
    if not schedule:
        return 1.0
    if schedule == "1F1B":
        return min(pp - stage, micro_batches)
    if schedule == "FThenB":
        return micro_batches
    if schedule == "VPP":
        startup = 2 * (pp - stage - 1) + (vpp - 1) * (micro_batches % pp + pp)
        return min(startup + 1, micro_batches * vpp) / vpp
    return (2 * pp + 1) / 2
