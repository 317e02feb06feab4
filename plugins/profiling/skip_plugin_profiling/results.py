"""What the analyses return: plain dataclasses of tables and numbers, for the findings, the
report, tests and any other tool; nothing here computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

TAIL_ASSUMPTIONS = (
    "engine throughput is unchanged: each request keeps its own time per generated token",
    "a truncated response ends at the cap and would score differently (often as a failure)",
    "oversampled requests come from the same distribution; saved_s leaves out their extra load, which "
    "extra_time_s bounds for saturated engines",
    "only request time is modelled: work after the last request (padding, barrier) is unchanged",
)


@dataclass
class Completion:
    """Per step: requests, rollout time and when 50/80/95/99% of requests had completed.

    The headline compares a step's first 80% of requests with its last 20%, so only steps
    whose last 20% holds at least ``evidence.MIN_COUNT`` requests back it (``backed``)."""

    table: pa.Table
    curves: dict[int, np.ndarray]  # step -> sorted completion times relative to t0
    headline_pct: float | None  # median over the backed steps of the % of rollout time by which 80% completed
    backed: list[int] = field(default_factory=list)  # the steps the headline rests on


@dataclass
class RolloutTimes:
    """Rollout time per step against the median of the steps. Peaks are named only when the
    median rests on at least ``evidence.MIN_STEPS`` steps; with fewer, the steps above the
    threshold are ``left_out`` instead."""

    table: pa.Table  # step, rollout_time, ratio, peak
    median: float
    mad: float
    threshold: float
    peaks: list[int]
    left_out: list[int] = field(default_factory=list)


@dataclass
class Workers:
    """One step's rollout workers: when each finished, who waited at the barrier for whom,
    where nothing finished.

    The straggler is the worker the others waited for: the smallest barrier wait (ties: the
    latest last completion). ``lag`` is how much longer the others waited than it (median);
    with one worker there is no one to compare, so no straggler and ``balanced`` is None.
    """

    step: int
    rollout_time: float
    table: pa.Table  # workid, busy, wait, total, requests, finish, gap...
    straggler: int | None
    lag: float
    threshold: float  # a lag above this names a straggler
    mean_wait_others: float
    max_wait_others: float
    balanced: bool | None
    completions: dict[int, np.ndarray]  # worker -> sorted completion times relative to t0


@dataclass
class SlowRequest:
    step: int
    workid: int
    request_id: str
    duration: float
    start: float  # relative to the step's t0
    events: list[dict[str, Any]]  # event, turn, start/end relative to the request's start, duration, attrs
    dominant_event: str | None
    dominant_seconds: float
    dominant_count: int


@dataclass
class EventOutliers:
    """Spans far above their own event's usual time, over all steps. ``table``: event,
    raw_event, request_id, step, workid, turn, duration, usual (what the event's median gives
    for this span), ratio (duration / usual); the largest excess first."""

    table: pa.Table
    medians: dict[str, float]  # event -> median duration, for every event judged
    spans: dict[str, int]  # event -> spans judged
    per_token: dict[str, bool]  # event -> judged per generated token (else per span)
    unjudged: dict[str, int] = field(default_factory=dict)  # event -> spans, too few for a median


@dataclass
class EventShares:
    """Per (step, worker), each instant of T = busy + barrier wait split evenly among the leaf
    spans open at it; an event's share is its part of T. ``table`` (event, mean_share,
    mean_seconds, pairs) ends with the row ``OTHER``: time no leaf span covered."""

    table: pa.Table
    per_step: pa.Table  # step, event, share
    containers: list[str]
    pairs: int


@dataclass
class Turns:
    by_turn: pa.Table  # step, turn, mean_generate, calls
    by_count: pa.Table  # turns, requests, mean_duration
    distribution: pa.Table  # step, turns, requests, share


@dataclass
class TailAdvice:
    caps: pa.Table  # length, label, truncated, truncated_share, saved_s, saved_pct
    oversample: pa.Table  # drop, dropped, saved_s, saved_pct, extra_requests_pct, extra_time_s
    total_rollout: float  # wall time of the steps' rollouts, overlapping steps counted once
    requests: int = 0
    with_tokens: int = 0  # requests with a token count: the caps' denominator
    assumptions: tuple[str, ...] = TAIL_ASSUMPTIONS
    note: str = ""


@dataclass
class TrainerPhases:
    """Exclusive seconds per trainer phase per step: ``table`` has ``step``, ``total`` (the
    step's wall time), a column per phase (its time outside the phases it holds, so the
    columns stack up to the total) and ``other`` (the step's time outside every phase)."""

    table: pa.Table
    phases: list[str]  # in the order they first ran
    nested: dict[str, list[str]]  # phase holding others -> the phases it holds


@dataclass
class Finding:
    """One plain sentence for a reader plus the values it names, for tests and tools."""

    kind: str
    text: str
    step: int | None = None
    worker: int | None = None
    request_id: str | None = None
    event: str | None = None
    seconds: float | None = None
    share: float | None = None
    ratio: float | None = None
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Analysis:
    phase: str
    step: int | None  # the step analysed in detail
    completion: Completion
    rollout: RolloutTimes
    workers: Workers | None
    slowest: list[SlowRequest]
    outliers: EventOutliers
    shares: EventShares
    turns: Turns
    tail: TailAdvice
    trainer: TrainerPhases | None
    events: int = 0
    files: int = 0
    lines_skipped: int = 0
