"""The analyses that explain a slow rollout, as pure functions over the normalized table.

They productize the methods of the verl multi-turn rollout profiling article: the long tail of
request completion, rollout time peaks, a straggler worker holding the others at the barrier,
the requests that took longest and the event that made them long, single events far above
their usual time, each event's share of the workers' time, turns; plus a tail advisor that
estimates what capping the response length or oversampling would save, and the trainer's
phases. This module is the entry point: ``analyze`` runs them all over one shared ``Frame``;
each lives in a module named for what it looks at (``rollout``, ``workers``, ``slowest``,
``advisor``, ``trainer_phases``) and ``findings`` turns the results into sentences.
"""

from __future__ import annotations

import pyarrow as pa

from skip_plugin_profiling import advisor, rollout, slowest
from skip_plugin_profiling import workers as per_worker
from skip_plugin_profiling.findings import describe
from skip_plugin_profiling.frame import frame_of, table_of
from skip_plugin_profiling.logs import Logs
from skip_plugin_profiling.results import (
    Analysis,
    Completion,
    EventOutliers,
    EventShares,
    Finding,
    RolloutTimes,
    SlowRequest,
    TailAdvice,
    TrainerPhases,
    Turns,
    Workers,
)
from skip_plugin_profiling.rollout import QUANTILES
from skip_plugin_profiling.trainer_phases import trainer_phases as _trainer_phases

__all__ = [
    "QUANTILES",
    "Analysis",
    "Completion",
    "EventOutliers",
    "EventShares",
    "Finding",
    "RolloutTimes",
    "SlowRequest",
    "TailAdvice",
    "TrainerPhases",
    "Turns",
    "Workers",
    "analyze",
    "completion",
    "event_outliers",
    "event_shares",
    "findings",
    "rollout_times",
    "slowest_requests",
    "tail_advisor",
    "trainer_phases",
    "turns",
    "workers",
]

Source = Logs | pa.Table


def analyze(
    source: Source,
    step: int | None = None,
    top: int = 5,
    lengths: tuple[int, ...] | list[int] = (),
    phase: str | None = None,
) -> Analysis:
    """Every analysis at once, sharing the extracted columns; raises ValueError for a step that
    has no rollout events."""
    fr = frame_of(source, phase)
    chosen = rollout.chosen_step(fr, step)
    logs = source if isinstance(source, Logs) else None
    return Analysis(
        phase=fr.phase,
        step=chosen,
        completion=rollout.completion(fr),
        rollout=rollout.rollout_times(fr),
        workers=per_worker.workers(fr, chosen),
        slowest=slowest.slowest_requests(fr, chosen, top),
        outliers=slowest.event_outliers(fr),
        shares=per_worker.event_shares(fr),
        turns=rollout.turns(fr),
        tail=advisor.tail_advice(fr, lengths),
        trainer=_trainer_phases(table_of(source)),
        events=fr.n,
        files=len(logs.files) if logs else 0,
        lines_skipped=logs.lines_skipped if logs else 0,
    )


def findings(source: Source | Analysis, step: int | None = None) -> list[Finding]:
    """The plain sentences a report opens with, most actionable first."""
    return describe(source if isinstance(source, Analysis) else analyze(source, step=step))


def completion(source: Source, phase: str | None = None) -> Completion:
    return rollout.completion(frame_of(source, phase))


def rollout_times(source: Source, phase: str | None = None) -> RolloutTimes:
    return rollout.rollout_times(frame_of(source, phase))


def workers(source: Source, step: int | None = None, phase: str | None = None) -> Workers | None:
    fr = frame_of(source, phase)
    return per_worker.workers(fr, rollout.chosen_step(fr, step))


def slowest_requests(
    source: Source, step: int | None = None, top: int = 5, phase: str | None = None
) -> list[SlowRequest]:
    fr = frame_of(source, phase)
    return slowest.slowest_requests(fr, rollout.chosen_step(fr, step), top)


def event_outliers(source: Source, phase: str | None = None) -> EventOutliers:
    return slowest.event_outliers(frame_of(source, phase))


def event_shares(source: Source, phase: str | None = None) -> EventShares:
    return per_worker.event_shares(frame_of(source, phase))


def turns(source: Source, phase: str | None = None) -> Turns:
    return rollout.turns(frame_of(source, phase))


def tail_advisor(
    source: Source,
    lengths: tuple[int, ...] | list[int] = (),
    drops: tuple[float, ...] = advisor.DROPS,
    phase: str | None = None,
) -> TailAdvice:
    return advisor.tail_advice(frame_of(source, phase), lengths, drops)


def trainer_phases(source: Source) -> TrainerPhases | None:
    """Exclusive seconds per ``trainer/<phase>`` (driver, workid -1) per step; None when none."""
    return _trainer_phases(table_of(source))
