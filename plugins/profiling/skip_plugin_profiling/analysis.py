"""The analyses that explain a slow rollout, as pure functions over the normalized table.

They productize the methods of the verl multi-turn rollout profiling article: the long tail of
request completion, rollout time peaks, a straggler worker holding the others at the barrier,
the requests that took longest and the event that made them long, each event's share of the
workers' time, turns; plus a tail advisor that estimates what capping the response length or
oversampling and dropping the slowest requests would save.

Everything is vectorized with numpy over columns extracted once (``_Frame``): a million events
take seconds. Python loops only run over steps, workers or the few slowest requests.

Times are seconds; "relative" times count from the step's ``t0``, the first start of any
rollout-side event (``workid >= 0``) of that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from skip_plugin_profiling.logs import Logs

#: Spans that contain other spans: counting them in shares would count their children twice.
OUTSIDE_ROLLOUT = ("weight_sync",)
CONTAINERS = frozenset({"rollout", "request", "turn"})
QUANTILES = (0.5, 0.8, 0.95, 0.99)
TOKEN_PERCENTILES = (50, 80, 90, 95, 99)
DROPS = (0.05, 0.10, 0.20)
#: A step is a peak when its rollout time exceeds median + PEAK_MADS × MAD and PEAK_RATIO × median.
PEAK_MADS, PEAK_RATIO, MAD_FLOOR = 3.0, 1.25, 0.05
#: A gap between completions is flagged above max(GAP_MIN_S, GAP_FACTOR × median gap, GAP_ROLLOUT × rollout).
GAP_MIN_S, GAP_FACTOR, GAP_ROLLOUT = 10.0, 5.0, 0.20
TAIL_ASSUMPTIONS = (
    "engine throughput is unchanged: each request keeps its own time per generated token",
    "a truncated response ends at the cap and would score differently (often as a failure)",
    "oversampled requests come from the same distribution; their extra load on the engine is not modelled",
    "only request time is modelled: work after the last request (padding, barrier) is unchanged",
)


# --- results ---------------------------------------------------------------------------------


@dataclass
class Completion:
    """Per step: requests, rollout time and when 50/80/95/99% of requests had completed."""

    table: pa.Table
    curves: dict[int, np.ndarray]  # step -> sorted completion times relative to t0
    headline_pct: float | None  # median over steps of the % of rollout time by which 80% completed


@dataclass
class RolloutTimes:
    table: pa.Table  # step, rollout_time, ratio, peak
    median: float
    mad: float
    threshold: float
    peaks: list[int]


@dataclass
class Workers:
    """One step's rollout workers: who was busy, who waited at the barrier, where nothing finished."""

    step: int
    rollout_time: float
    table: pa.Table
    straggler: int | None
    straggler_busy: float
    straggler_excess: float  # its busy time minus the median busy time of the others
    mean_wait_others: float
    max_wait_others: float
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
class EventShares:
    table: pa.Table  # event, mean_share, mean_seconds, pairs: sorted by mean_share descending
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
    caps: pa.Table  # length, label, truncated_share, saved_s, saved_pct
    oversample: pa.Table  # drop, saved_s, saved_pct, extra_requests_pct, extra_generate_s
    total_rollout: float
    assumptions: tuple[str, ...] = TAIL_ASSUMPTIONS
    note: str = ""


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
    shares: EventShares
    turns: Turns
    tail: TailAdvice
    trainer: pa.Table | None
    events: int = 0
    files: int = 0
    lines_skipped: int = 0


# --- columns extracted once ------------------------------------------------------------------


class _Frame:
    """numpy views of one phase's events and the per-request / per-step / per-worker aggregates
    every analysis shares, each computed at most once."""

    def __init__(self, table: pa.Table, phase: str) -> None:
        self.table, self.phase = table, phase
        self.n = table.num_rows
        self.step = _ints(table, "step")
        self.workid = _ints(table, "workid")
        self.start = _floats(table, "start")
        self.end = np.maximum(_floats(table, "end"), self.start)
        events = table["event"].combine_chunks().dictionary_encode()
        self.names: list[str] = events.dictionary.to_pylist()
        self.event = pc.fill_null(events.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        rids = table["request_id"].combine_chunks().dictionary_encode()
        self.rid_names = rids.dictionary
        self.rid = pc.fill_null(rids.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)

    def code(self, name: str) -> int:
        return self.names.index(name) if name in self.names else -2

    def is_event(self, name: str) -> np.ndarray:
        return self.event == self.code(name)

    def column(self, name: str) -> np.ndarray:
        return _floats(self.table, name)

    @cached_property
    def side(self) -> np.ndarray:
        """Rollout-side events: a rollout worker's, or the driver's about one (barrier waits).
        A worker's ``weight_sync`` loads the next rollout's weights after the step trained:
        counting it would stretch the rollout over the whole training step."""
        outside = np.isin(self.event, [self.code(name) for name in OUTSIDE_ROLLOUT])
        return (self.workid >= 0) & ~outside

    @cached_property
    def steps(self) -> _Steps:
        return _Steps(self)

    @cached_property
    def requests(self) -> _Requests:
        return _Requests(self)

    @cached_property
    def pairs(self) -> _Pairs:
        return _Pairs(self)

    @cached_property
    def containers(self) -> list[str]:
        return _containers(self)


class _Steps:
    """Steps with rollout-side events: t0, end and rollout time."""

    def __init__(self, fr: _Frame) -> None:
        steps = np.unique(fr.step[fr.side])
        self.ids = steps
        idx = np.searchsorted(steps, fr.step[fr.side])
        self.t0 = _reduce(idx, len(steps), fr.start[fr.side], "min")
        self.end = _reduce(idx, len(steps), fr.end[fr.side], "max")
        self.rollout_time = self.end - self.t0

    def index(self, step: np.ndarray | int) -> np.ndarray:
        return np.searchsorted(self.ids, step)


class _Requests:
    """One row per (step, request_id): who ran it, when, how many turns and tokens."""

    def __init__(self, fr: _Frame) -> None:
        rows = np.flatnonzero((fr.rid >= 0) & fr.side)
        key = fr.step[rows] * (len(fr.rid_names) + 1) + fr.rid[rows]
        uniq, inv = np.unique(key, return_inverse=True)
        n = len(uniq)
        self.rows, self.of_row = rows, inv
        self.index = np.full(fr.n, -1)
        self.index[rows] = inv
        self.n = n
        self.step = _reduce(inv, n, fr.step[rows], "max").astype(np.int64)
        self.workid = _reduce(inv, n, fr.workid[rows], "min").astype(np.int64)
        self.rid = _reduce(inv, n, fr.rid[rows], "max").astype(np.int64)
        self.start = _reduce(inv, n, fr.start[rows], "min")
        self.end = _reduce(inv, n, fr.end[rows], "max")
        self.duration = self.end - self.start
        t0 = fr.steps.t0[fr.steps.index(self.step)] if n else np.zeros(0)
        self.rel_start, self.rel_end = self.start - t0, self.end - t0
        self._generate(fr, rows, inv)
        self._attributes(fr, rows, inv)

    def _generate(self, fr: _Frame, rows: np.ndarray, inv: np.ndarray) -> None:
        gen = fr.is_event("generate")[rows]
        self.generates = np.bincount(inv, weights=gen, minlength=self.n).astype(np.int64)
        duration = fr.end[rows] - fr.start[rows]
        self.gen_time = np.bincount(inv, weights=np.where(gen, duration, 0.0), minlength=self.n)
        tokens = fr.column("tokens_out")[rows]
        known = gen & ~np.isnan(tokens)
        summed = np.bincount(inv, weights=np.where(known, tokens, 0.0), minlength=self.n)
        self.tokens = np.where(np.bincount(inv, weights=known, minlength=self.n) > 0, summed, np.nan)

    def _attributes(self, fr: _Frame, rows: np.ndarray, inv: np.ndarray) -> None:
        turns = _reduce(inv, self.n, fr.column("turns")[rows], "max")
        self.turns = np.where(np.isnan(turns), self.generates, turns).astype(np.int64)
        response = _reduce(inv, self.n, fr.column("response_tokens")[rows], "max")
        self.tokens = np.where(np.isnan(self.tokens), response, self.tokens)

    def ids(self, fr: _Frame, which: np.ndarray) -> list[str]:
        return pc.take(fr.rid_names, pa.array(self.rid[which])).to_pylist()


class _Pairs:
    """One row per (step, rollout worker): busy time, barrier wait, their sum T, requests.

    busy: the worker's ``rollout`` span(s) less any barrier wait they overlap (the article's
    ``total_step_duration`` may include the wait, our ``rollout`` does not; subtracting the
    overlap is right for both); without a ``rollout`` span, first start to last end of its
    other events. wait: its ``barrier_wait`` spans; without them, the step's last end minus the
    worker's last end.
    """

    def __init__(self, fr: _Frame) -> None:
        side = np.flatnonzero(fr.side)
        key = fr.step[side] * (fr.workid.max(initial=0) + 1) + fr.workid[side]
        uniq, inv = np.unique(key, return_inverse=True)
        self.n = n = len(uniq)
        self.index = np.full(fr.n, -1)
        self.index[side] = inv
        self.step = _reduce(inv, n, fr.step[side], "max").astype(np.int64)
        self.workid = _reduce(inv, n, fr.workid[side], "max").astype(np.int64)
        barrier, rollout = fr.is_event("barrier_wait")[side], fr.is_event("rollout")[side]
        own = ~barrier
        s, e = fr.start[side], fr.end[side]
        self.first = _reduce(inv[own], n, s[own], "min")
        self.last = _reduce(inv[own], n, e[own], "max")
        wait = _union_length(inv[barrier], s[barrier], e[barrier], n)
        both = barrier | rollout
        busy = _union_length(inv[both], s[both], e[both], n) - wait
        has_rollout = np.bincount(inv[rollout], minlength=n) > 0
        has_barrier = np.bincount(inv[barrier], minlength=n) > 0
        self.busy = np.where(has_rollout, busy, np.nan_to_num(self.last - self.first))
        steps, of_step = np.unique(self.step, return_inverse=True)
        step_last = _reduce(of_step, len(steps), self.last, "max")[of_step]
        self.wait = np.where(has_barrier, wait, np.nan_to_num(np.maximum(step_last - self.last, 0.0)))
        self.total = self.busy + self.wait
        req = fr.requests
        req_pair = self.index[req.rows[np.unique(req.of_row, return_index=True)[1]]] if req.n else np.zeros(0, int)
        self.requests = np.bincount(req_pair, minlength=n).astype(np.int64)
        self.request_pair = req_pair


def _containers(fr: _Frame) -> list[str]:
    """Names whose spans mostly have children, plus the fixed containers: a name is judged by
    majority so one odd nesting does not hide it. Span ids are unique within one process's
    file (``pid`` alone can repeat across nodes), so parents are looked up by (file, span id)."""
    names = set(CONTAINERS) & set(fr.names)
    source = "file" if "file" in fr.table.column_names and fr.table["file"].null_count == 0 else "pid"
    pid, span, parent = (_ints(fr.table, c, -1) for c in (source, "span_id", "parent_id"))
    has = (pid >= 0) & (span > 0)
    if not has.any():
        return sorted(names)
    width = int(max(span.max(), parent.max())) + 1
    child = has & (parent > 0)
    parents = np.unique(pid[child] * width + parent[child])
    is_parent = has & np.isin(pid * width + span, parents)
    counts = np.bincount(fr.event[fr.event >= 0], minlength=len(fr.names))
    parented = np.bincount(fr.event[is_parent & (fr.event >= 0)], minlength=len(fr.names))
    names |= {fr.names[i] for i in np.flatnonzero(parented * 2 > counts)}
    return sorted(names)


# --- public analyses -------------------------------------------------------------------------


def completion(source: Logs | pa.Table, phase: str | None = None) -> Completion:
    return _completion(_frame(source, phase))


def rollout_times(source: Logs | pa.Table, phase: str | None = None) -> RolloutTimes:
    return _rollout_times(_frame(source, phase))


def workers(source: Logs | pa.Table, step: int | None = None, phase: str | None = None) -> Workers | None:
    fr = _frame(source, phase)
    return _workers(fr, _chosen(fr, step))


def slowest_requests(
    source: Logs | pa.Table, step: int | None = None, top: int = 5, phase: str | None = None
) -> list[SlowRequest]:
    fr = _frame(source, phase)
    return _slowest(fr, _chosen(fr, step), top)


def event_shares(source: Logs | pa.Table, phase: str | None = None) -> EventShares:
    return _event_shares(_frame(source, phase))


def turns(source: Logs | pa.Table, phase: str | None = None) -> Turns:
    return _turns(_frame(source, phase))


def tail_advisor(
    source: Logs | pa.Table,
    lengths: tuple[int, ...] | list[int] = (),
    drops: tuple[float, ...] = DROPS,
    phase: str | None = None,
) -> TailAdvice:
    return _tail(_frame(source, phase), lengths, drops)


def trainer_phases(source: Logs | pa.Table) -> pa.Table | None:
    """Seconds per ``trainer/<phase>`` (driver, workid -1) per step; None when none were logged."""
    table = _table(source)
    names = table["event"]
    mask = pc.and_(pc.equal(table["workid"], -1), pc.starts_with(names, "trainer/"))
    rows = table.filter(pc.fill_null(mask, False))
    if rows.num_rows == 0:
        return None
    sums = rows.group_by(["step", "event"]).aggregate([("duration", "sum")]).to_pydict()
    steps = sorted(set(sums["step"]))
    order = (
        pa.table({"event": sums["event"], "s": sums["duration_sum"]})
        .group_by("event")
        .aggregate([("s", "sum")])
        .sort_by([("s_sum", "descending")])
    )
    phases = order["event"].to_pylist()
    cells = {(s, e): d for s, e, d in zip(sums["step"], sums["event"], sums["duration_sum"], strict=True)}
    columns: dict[str, list] = {"step": steps}
    for name in phases:
        columns[name.removeprefix("trainer/")] = [cells.get((s, name), 0.0) for s in steps]
    return pa.table(columns)


def analyze(
    source: Logs | pa.Table,
    step: int | None = None,
    top: int = 5,
    lengths: tuple[int, ...] | list[int] = (),
    phase: str | None = None,
) -> Analysis:
    """Every analysis at once, sharing the extracted columns; raises ValueError for a step that
    has no rollout events."""
    fr = _frame(source, phase)
    chosen = _chosen(fr, step)
    logs = source if isinstance(source, Logs) else None
    return Analysis(
        phase=fr.phase,
        step=chosen,
        completion=_completion(fr),
        rollout=_rollout_times(fr),
        workers=_workers(fr, chosen),
        slowest=_slowest(fr, chosen, top),
        shares=_event_shares(fr),
        turns=_turns(fr),
        tail=_tail(fr, lengths, DROPS),
        trainer=trainer_phases(source),
        events=fr.n,
        files=len(logs.files) if logs else 0,
        lines_skipped=logs.lines_skipped if logs else 0,
    )


# --- implementations -------------------------------------------------------------------------


def _completion(fr: _Frame) -> Completion:
    req, steps = fr.requests, fr.steps
    columns: dict[str, list] = {"step": [], "requests": [], "rollout_time": []}
    for q in QUANTILES:
        columns[f"t{round(q * 100)}_s"], columns[f"t{round(q * 100)}_pct"] = [], []
    curves = {}
    for i, step in enumerate(steps.ids.tolist()):
        done = np.sort(req.rel_end[req.step == step])
        if not len(done):
            continue
        curves[step] = done
        rollout = steps.rollout_time[i]
        columns["step"].append(step)
        columns["requests"].append(len(done))
        columns["rollout_time"].append(float(rollout))
        for q in QUANTILES:
            at = float(np.quantile(done, q, method="inverted_cdf"))
            columns[f"t{round(q * 100)}_s"].append(at)
            columns[f"t{round(q * 100)}_pct"].append(100 * at / rollout if rollout > 0 else math.nan)
    pct80 = columns["t80_pct"]
    headline = float(np.median(pct80)) if pct80 else None
    return Completion(pa.table(columns), curves, headline)


def _rollout_times(fr: _Frame) -> RolloutTimes:
    steps = fr.steps
    times = steps.rollout_time
    if not len(times):
        empty = pa.table({"step": pa.array([], pa.int64()), "rollout_time": pa.array([], pa.float64())})
        return RolloutTimes(empty, math.nan, math.nan, math.nan, [])
    median = float(np.median(times))
    mad = max(float(np.median(np.abs(times - median))), MAD_FLOOR * median)
    threshold = max(median + PEAK_MADS * mad, PEAK_RATIO * median)
    peak = times > threshold
    table = pa.table(
        {"step": steps.ids, "rollout_time": times, "ratio": times / median if median > 0 else times * 0, "peak": peak}
    )
    return RolloutTimes(table, median, mad, threshold, steps.ids[peak].tolist())


def _chosen(fr: _Frame, step: int | None) -> int | None:
    steps = fr.steps
    if step is None:
        return int(steps.ids[np.argmax(steps.rollout_time)]) if len(steps.ids) else None
    if step not in steps.ids.tolist():
        available = ", ".join(map(str, steps.ids.tolist())) or "none"
        raise ValueError(f"step {step} has no rollout events in phase {fr.phase!r}; steps available: {available}")
    return int(step)


def _workers(fr: _Frame, step: int | None) -> Workers | None:
    if step is None:
        return None
    pairs, req = fr.pairs, fr.requests
    rows = np.flatnonzero(pairs.step == step)
    rows = rows[np.argsort(pairs.workid[rows])]
    rollout = float(fr.steps.rollout_time[fr.steps.index(step)])
    completions = {}
    gaps = []
    for p in rows.tolist():
        done = np.sort(req.rel_end[(req.step == step) & (req.workid == pairs.workid[p])])
        completions[int(pairs.workid[p])] = done
        gaps.append(_largest_gap(done, rollout))
    table = pa.table(
        {
            "workid": pairs.workid[rows],
            "busy": pairs.busy[rows],
            "wait": pairs.wait[rows],
            "total": pairs.total[rows],
            "requests": pairs.requests[rows],
            "end": pairs.last[rows] - fr.steps.t0[fr.steps.index(step)],
            "gap": [g[0] for g in gaps],
            "gap_from": [g[1] for g in gaps],
            "gap_to": [g[2] for g in gaps],
            "gap_threshold": [g[3] for g in gaps],
            "gap_flagged": [g[0] > g[3] for g in gaps],
        }
    )
    return _with_straggler(step, rollout, table, completions)


def _largest_gap(done: np.ndarray, rollout: float) -> tuple[float, float, float, float]:
    """(gap, from, to, threshold) of the longest time between consecutive completions.

    Threshold: max(10 s, 5 × the median gap, 20% of the rollout): the last completions of any
    long tail are sparse, so only a gap that is a large part of the step is worth a sentence.
    The median needs three gaps to ignore the outlier it judges; with fewer only the floors apply.
    """
    floor = max(GAP_MIN_S, GAP_ROLLOUT * rollout)
    if len(done) < 2:
        return 0.0, math.nan, math.nan, floor
    diffs = np.diff(done)
    i = int(np.argmax(diffs))
    typical = float(np.median(diffs)) if len(diffs) >= 3 else 0.0
    return float(diffs[i]), float(done[i]), float(done[i + 1]), max(floor, GAP_FACTOR * typical)


def _with_straggler(step: int, rollout: float, table: pa.Table, completions: dict) -> Workers:
    busy, wait = table["busy"].to_numpy(), table["wait"].to_numpy()
    ids = table["workid"].to_numpy()
    if not len(ids):
        return Workers(step, rollout, table, None, math.nan, math.nan, math.nan, math.nan, completions)
    s = int(np.argmax(busy))
    others = np.arange(len(ids)) != s
    excess = float(busy[s] - np.median(busy[others])) if others.any() else 0.0
    mean_wait = float(wait[others].mean()) if others.any() else 0.0
    max_wait = float(wait[others].max()) if others.any() else 0.0
    return Workers(step, rollout, table, int(ids[s]), float(busy[s]), excess, mean_wait, max_wait, completions)


def _slowest(fr: _Frame, step: int | None, top: int) -> list[SlowRequest]:
    req = fr.requests
    if step is None or top <= 0:
        return []
    mine = np.flatnonzero(req.step == step)
    chosen = mine[np.argsort(-req.duration[mine], kind="stable")[:top]]
    if not len(chosen):
        return []
    rows = np.flatnonzero(np.isin(req.index, chosen))
    events = fr.table.take(pa.array(rows)).to_pylist()
    by_request: dict[int, list[dict]] = {int(r): [] for r in chosen}
    for row, event in zip(req.index[rows].tolist(), events, strict=True):
        by_request[row].append(event)
    ids = req.ids(fr, chosen)
    containers = set(fr.containers)
    return [_slow_request(req, int(r), rid, by_request[int(r)], containers) for r, rid in zip(chosen, ids, strict=True)]


def _slow_request(req: _Requests, r: int, rid: str, events: list[dict], containers: set[str]) -> SlowRequest:
    origin = req.start[r]
    core = {"step", "phase", "workid", "event", "raw_event", "start", "end", "duration", "request_id", "turn"}
    core |= {"span_id", "parent_id", "pid", "file"}
    rows = []
    for e in sorted(events, key=lambda e: (e["start"], -e["end"])):
        attrs = {k: v for k, v in e.items() if v is not None and k not in core}
        rows.append(
            {
                "event": e["event"],
                "turn": e["turn"],
                "start": e["start"] - origin,
                "end": e["end"] - origin,
                "duration": e["end"] - e["start"],
                "attrs": attrs,
            }
        )
    dominant, seconds, count = _dominant([r for r in rows if r["event"] not in containers])
    return SlowRequest(
        int(req.step[r]),
        int(req.workid[r]),
        rid,
        float(req.duration[r]),
        float(req.rel_start[r]),
        rows,
        dominant,
        seconds,
        count,
    )


def _dominant(rows: list[dict]) -> tuple[str | None, float, int]:
    """The event name whose spans cover the most of the request (union: parallel spans once)."""
    best: tuple[str | None, float, int] = (None, 0.0, 0)
    for name in dict.fromkeys(r["event"] for r in rows):
        spans = [(r["start"], r["end"]) for r in rows if r["event"] == name]
        covered = float(_union_length(np.zeros(len(spans), int), *map(np.array, zip(*spans, strict=True)), 1)[0])
        if covered > best[1]:
            best = (name, covered, len(spans))
    return best


def _event_shares(fr: _Frame) -> EventShares:
    pairs = fr.pairs
    containers = fr.containers
    skip = np.isin(fr.event, [fr.code(c) for c in containers])
    rows = np.flatnonzero(fr.side & ~skip & (fr.event >= 0))
    n_events = len(fr.names)
    group = pairs.index[rows] * n_events + fr.event[rows]
    covered = _union_length(group, fr.start[rows], fr.end[rows], pairs.n * n_events).reshape(pairs.n, n_events)
    total = pairs.total[:, None]
    share = np.divide(covered, total, out=np.zeros_like(covered), where=total > 0)
    present = np.bincount(group, minlength=pairs.n * n_events).reshape(pairs.n, n_events) > 0
    used = np.flatnonzero(present.any(axis=0))
    n = max(pairs.n, 1)
    table = pa.table(
        {
            "event": [fr.names[i] for i in used],
            "mean_share": share[:, used].sum(axis=0) / n,
            "mean_seconds": covered[:, used].sum(axis=0) / n,
            "pairs": present[:, used].sum(axis=0),
        }
    ).sort_by([("mean_share", "descending")])
    return EventShares(table, _shares_per_step(fr, share, used), containers, pairs.n)


def _shares_per_step(fr: _Frame, share: np.ndarray, used: np.ndarray) -> pa.Table:
    steps, inv = np.unique(fr.pairs.step, return_inverse=True)
    counts = np.bincount(inv, minlength=len(steps))
    sums = np.zeros((len(steps), share.shape[1]))
    np.add.at(sums, inv, share)
    means = sums / np.maximum(counts, 1)[:, None]
    return pa.table(
        {
            "step": np.repeat(steps, len(used)),
            "event": [fr.names[i] for i in used] * len(steps),
            "share": means[:, used].reshape(-1),
        }
    )


def _turns(fr: _Frame) -> Turns:
    req = fr.requests
    gen = np.flatnonzero(fr.is_event("generate") & (req.index >= 0))
    turn = _turn_index(fr, gen)
    key_step, key_turn = fr.step[gen], turn
    by_turn = _mean_by(
        {"step": key_step, "turn": key_turn}, fr.end[gen] - fr.start[gen], "mean_generate", "calls"
    ).sort_by([("step", "ascending"), ("turn", "ascending")])
    by_count = _mean_by({"turns": req.turns}, req.duration, "mean_duration", "requests").sort_by("turns")
    distribution = _mean_by({"step": req.step, "turns": req.turns}, req.duration, "_", "requests").drop_columns("_")
    per_step = dict(zip(*np.unique(req.step, return_counts=True), strict=True))
    steps = distribution["step"].to_pylist()
    distribution = distribution.append_column(
        "share", pa.array([c / per_step[s] for s, c in zip(steps, distribution["requests"].to_pylist(), strict=True)])
    ).sort_by([("step", "ascending"), ("turns", "ascending")])
    return Turns(by_turn, by_count, distribution)


def _turn_index(fr: _Frame, gen: np.ndarray) -> np.ndarray:
    """The logged ``turn``, else the call's rank by start within its request (article logs)."""
    logged = _ints(fr.table, "turn", -1)[gen]
    if (logged > 0).all():
        return logged
    req = fr.requests.index[gen]
    order = np.lexsort((fr.start[gen], req))
    ranked = np.empty(len(gen), np.int64)
    sorted_req = req[order]
    first = np.r_[0, np.flatnonzero(np.diff(sorted_req)) + 1] if len(gen) else np.zeros(0, int)
    starts = np.repeat(first, np.diff(np.r_[first, len(gen)]))
    ranked[order] = np.arange(len(gen)) - starts + 1
    return np.where(logged > 0, logged, ranked)


def _mean_by(keys: dict[str, np.ndarray], values: np.ndarray, mean: str, count: str) -> pa.Table:
    table = pa.table({**keys, "v": values}).group_by(list(keys)).aggregate([("v", "mean"), ("v", "count")])
    return table.select([*keys, "v_mean", "v_count"]).rename_columns([*keys, mean, count])


def _tail(fr: _Frame, lengths, drops) -> TailAdvice:
    req, steps = fr.requests, fr.steps
    step_idx = steps.index(req.step) if req.n else np.zeros(0, int)
    base = _reduce(step_idx, len(steps.ids), req.rel_end, "max")
    total = float(np.nansum(steps.rollout_time))
    caps, note = _caps(req, step_idx, base, len(steps.ids), total, lengths)
    over = _oversample(req, step_idx, base, len(steps.ids), total, drops)
    return TailAdvice(caps, over, total, note=note)


def _caps(req, step_idx, base, n_steps, total, lengths) -> tuple[pa.Table, str]:
    """Each request loses (tokens - L) × its own seconds per generated token when over L."""
    tokens = req.tokens
    known = ~np.isnan(tokens) & (tokens > 0)
    empty = {"length": [], "label": [], "truncated_share": [], "saved_s": [], "saved_pct": []}
    if not known.any():
        return pa.table(empty, schema=_CAPS_SCHEMA), "no token counts (tokens_out / response_tokens) in the logs"
    gen_time = np.where(req.gen_time > 0, req.gen_time, np.nan)
    per_token = np.where(known, gen_time / np.where(known, tokens, 1), np.nan)
    candidates = {_round2(np.percentile(tokens[known], p)): f"p{p}" for p in TOKEN_PERCENTILES}
    for length in lengths:
        candidates[int(length)] = "given"
    rows: dict[str, list] = {k: [] for k in empty}
    for length, label in sorted(candidates.items()):
        over = known & (tokens > length)
        cut = np.where(over & ~np.isnan(per_token), (tokens - length) * np.nan_to_num(per_token), 0.0)
        capped = _reduce(step_idx, n_steps, req.rel_start + np.maximum(req.duration - cut, 0.0), "max")
        saved = float(np.nansum(base - capped))
        rows["length"].append(length)
        rows["label"].append(label)
        rows["truncated_share"].append(float(over.sum() / known.sum()))
        rows["saved_s"].append(saved)
        rows["saved_pct"].append(100 * saved / total if total > 0 else math.nan)
    return pa.table(rows, schema=_CAPS_SCHEMA), ""


_CAPS_SCHEMA = pa.schema(
    [
        ("length", pa.int64()),
        ("label", pa.string()),
        ("truncated_share", pa.float64()),
        ("saved_s", pa.float64()),
        ("saved_pct", pa.float64()),
    ]
)


def _oversample(req, step_idx, base, n_steps, total, drops) -> pa.Table:
    """Launch n/(1-x), keep the first n: a step ends when a (1-x) share of its requests is done."""
    work = float(np.sum(np.where(req.gen_time > 0, req.gen_time, req.duration)))
    rows: dict[str, list] = {
        "drop": [],
        "saved_s": [],
        "saved_pct": [],
        "extra_requests_pct": [],
        "extra_generate_s": [],
    }
    for drop in drops:
        saved = 0.0
        for i in range(n_steps):
            done = req.rel_end[step_idx == i]
            if len(done):
                saved += float(base[i] - np.quantile(done, 1 - drop, method="inverted_cdf"))
        extra = drop / (1 - drop)
        rows["drop"].append(float(drop))
        rows["saved_s"].append(saved)
        rows["saved_pct"].append(100 * saved / total if total > 0 else math.nan)
        rows["extra_requests_pct"].append(100 * extra)
        rows["extra_generate_s"].append(extra * work)
    return pa.table(rows)


def _round2(x: float) -> int:
    """Two significant digits: 1234 -> 1200, the kind of number one puts in a config."""
    if x < 10:
        return max(1, round(x))
    digits = math.floor(math.log10(x)) - 1
    return int(round(x, -digits))


# --- findings ---------------------------------------------------------------------------------


def findings(source: Logs | pa.Table | Analysis, step: int | None = None) -> list[Finding]:
    """The plain sentences a report opens with, most actionable first."""
    result = source if isinstance(source, Analysis) else analyze(source, step=step)
    found: list[Finding] = []
    for make in (_f_read, _f_tail, _f_peaks, _f_straggler, _f_gaps, _f_slowest, _f_shares, _f_turns, _f_advisor):
        found.extend(make(result))
    return found


def _f_read(a: Analysis) -> list[Finding]:
    if not a.lines_skipped:
        return []
    text = f"{a.lines_skipped} log lines could not be read (truncated or not JSON) and were skipped."
    return [Finding("skipped_lines", text, values={"lines": a.lines_skipped})]


def _f_tail(a: Analysis) -> list[Finding]:
    c = a.completion
    if c.headline_pct is None:
        return []
    n = c.table.num_rows
    text = (
        f"80% of requests completed within the first {c.headline_pct:.0f}% of the rollout "
        f"(median over {n} step{'s' * (n != 1)}); the last 20% took the remaining {100 - c.headline_pct:.0f}%."
    )
    return [Finding("long_tail", text, share=c.headline_pct / 100, values={"steps": n})]


def _f_peaks(a: Analysis) -> list[Finding]:
    r = a.rollout
    out = []
    times = dict(zip(r.table["step"].to_pylist(), r.table["rollout_time"].to_pylist(), strict=True))
    for step in r.peaks:
        ratio = times[step] / r.median
        text = (
            f"Step {step}'s rollout took {times[step]:.1f} s, {ratio:.1f}× the median {r.median:.1f} s "
            f"(threshold {r.threshold:.1f} s)."
        )
        out.append(Finding("peak", text, step=step, seconds=times[step], ratio=ratio, values={"median": r.median}))
    return out


def _f_straggler(a: Analysis) -> list[Finding]:
    w = a.workers
    if w is None or w.straggler is None or w.table.num_rows < 2:
        return []
    significant = w.straggler_excess > max(1.0, 0.1 * w.straggler_busy)
    n_others = w.table.num_rows - 1
    if not significant:
        text = f"On step {w.step} the {w.table.num_rows} rollout workers were balanced (busy times within 10%)."
        return [Finding("balanced", text, step=w.step, seconds=w.straggler_excess)]
    text = (
        f"On step {w.step}, worker {w.straggler} was the straggler: busy {w.straggler_busy:.1f} s, "
        f"{w.straggler_excess:.1f} s more than the median of the others; the other {n_others} workers waited "
        f"{w.mean_wait_others:.1f} s on average (at most {w.max_wait_others:.1f} s) at the barrier."
    )
    values = {"busy": w.straggler_busy, "mean_wait": w.mean_wait_others, "max_wait": w.max_wait_others}
    return [Finding("straggler", text, step=w.step, worker=w.straggler, seconds=w.straggler_excess, values=values)]


def _f_gaps(a: Analysis, top: int = 3) -> list[Finding]:
    w = a.workers
    if w is None:
        return []
    out = []
    for row in w.table.to_pylist():
        if row["gap_flagged"]:
            text = (
                f"No request finished on worker {row['workid']} for {row['gap']:.1f} s "
                f"(from {row['gap_from']:.1f} s to {row['gap_to']:.1f} s into step {w.step}'s rollout)."
            )
            values = {"from": row["gap_from"], "to": row["gap_to"], "threshold": row["gap_threshold"]}
            out.append(Finding("gap", text, step=w.step, worker=row["workid"], seconds=row["gap"], values=values))
    return sorted(out, key=lambda f: -(f.seconds or 0))[:top]


def _f_slowest(a: Analysis) -> list[Finding]:
    if not a.slowest:
        return []
    r = a.slowest[0]
    text = f"The slowest request of step {r.step}, {r.request_id} on worker {r.workid}, took {r.duration:.1f} s"
    if r.dominant_event:
        calls = f" over {r.dominant_count} spans" if r.dominant_count > 1 else ""
        text += (
            f"; {r.dominant_event} took {r.dominant_seconds:.1f} s of it{calls} ({r.dominant_seconds / r.duration:.0%})"
        )
    values = {"event_seconds": r.dominant_seconds, "spans": r.dominant_count}
    return [
        Finding(
            "slow_request",
            text + ".",
            step=r.step,
            worker=r.workid,
            request_id=r.request_id,
            event=r.dominant_event,
            seconds=r.duration,
            share=r.dominant_seconds / r.duration if r.duration > 0 else None,
            values=values,
        )
    ]


def _f_shares(a: Analysis, top: int = 3) -> list[Finding]:
    out = []
    for row in a.shares.table.slice(0, top).to_pylist():
        text = (
            f"{row['event']} took {row['mean_share']:.1%} of a rollout worker's step (busy + barrier wait) on "
            f"average, {row['mean_seconds']:.1f} s per worker-step over {_plural(a.shares.pairs, 'worker-step')}."
        )
        out.append(
            Finding("event_share", text, event=row["event"], share=row["mean_share"], seconds=row["mean_seconds"])
        )
    return out


def _f_turns(a: Analysis) -> list[Finding]:
    rows = [r for r in a.turns.by_count.to_pylist() if r["turns"] > 0]
    if len(rows) < 2:
        return []
    lo, hi = rows[0], rows[-1]
    ratio = hi["mean_duration"] / lo["mean_duration"] if lo["mean_duration"] > 0 else math.nan
    text = (
        f"Requests with {hi['turns']} turns took {hi['mean_duration']:.1f} s on average, {ratio:.1f}× those with "
        f"{lo['turns']} turn{'s' * (lo['turns'] != 1)} ({lo['mean_duration']:.1f} s)."
    )
    return [Finding("turns", text, ratio=ratio, values={"turns": hi["turns"], "baseline_turns": lo["turns"]})]


def _f_advisor(a: Analysis) -> list[Finding]:
    out = []
    caps = [r for r in a.tail.caps.to_pylist() if r["truncated_share"] <= 0.05 and r["saved_s"] > 0]
    if caps:
        best = max(caps, key=lambda r: r["saved_s"])
        text = (
            f"Capping max_response_length at {best['length']} tokens would truncate {best['truncated_share']:.1%} "
            f"of requests and save an estimated {best['saved_s']:.1f} s ({best['saved_pct']:.1f}%) of rollout time."
        )
        values = {"length": best["length"], "truncated_share": best["truncated_share"]}
        out.append(Finding("tail_cap", text, seconds=best["saved_s"], share=best["saved_pct"] / 100, values=values))
    over = [r for r in a.tail.oversample.to_pylist() if r["saved_s"] > 0]
    if over:
        best = max(over, key=lambda r: r["saved_s"] / max(r["extra_requests_pct"], 1e-9))
        text = (
            f"Oversampling by {best['drop']:.0%} and dropping the slowest requests would save an estimated "
            f"{best['saved_s']:.1f} s ({best['saved_pct']:.1f}%) for {best['extra_requests_pct']:.0f}% more requests."
        )
        values = {"drop": best["drop"], "extra_requests_pct": best["extra_requests_pct"]}
        out.append(Finding("oversample", text, seconds=best["saved_s"], share=best["saved_pct"] / 100, values=values))
    return out


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


# --- helpers ----------------------------------------------------------------------------------


def _table(source: Logs | pa.Table) -> pa.Table:
    return source.table if isinstance(source, Logs) else source


def _frame(source: Logs | pa.Table, phase: str | None) -> _Frame:
    table = _table(source)
    phases = sorted(pc.unique(table["phase"]).drop_null().to_pylist())
    phase = phase or ("train" if "train" in phases or not phases else phases[0])
    return _Frame(table.filter(pc.fill_null(pc.equal(table["phase"], phase), False)), phase)


def _floats(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    column = table[name]
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        try:
            column = column.cast(pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return np.full(table.num_rows, np.nan)
    return pc.fill_null(column.cast(pa.float64()), np.nan).to_numpy()


def _ints(table: pa.Table, name: str, fill: int = 0) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, fill, np.int64)
    return pc.fill_null(table[name].cast(pa.int64()), fill).to_numpy()


def _reduce(groups: np.ndarray, n: int, values: np.ndarray, how: str) -> np.ndarray:
    """Per-group min or max, NaN where a group has no (non-NaN) value."""
    values = values.astype(np.float64, copy=False)  # mixed dtypes send ufunc.at down a slow path
    groups = groups.astype(np.intp, copy=False)
    ok = ~np.isnan(values)
    groups, values = groups[ok], values[ok]
    if how == "min":
        out = np.full(n, np.inf)
        np.minimum.at(out, groups, values)
    else:
        out = np.full(n, -np.inf)
        np.maximum.at(out, groups, values)
    out[np.isinf(out)] = np.nan
    return out


def _union_length(groups: np.ndarray, starts: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """Per group, the length of the union of [start, end) intervals, in one sorted pass.

    Sorted by (group, start), each interval adds what it reaches beyond the running maximum
    end of those before it in its group. Groups are laid end to end on one axis (offset by a
    span wider than all times) so a single ``maximum.accumulate`` serves every group.
    """
    if not len(groups):
        return np.zeros(n)
    order = np.lexsort((starts, groups))
    g, s = groups[order], starts[order]
    e = np.maximum(ends[order], s)
    base = s.min()
    width = float(e.max() - base) + 1.0
    offset = g * width - base
    reach = np.maximum.accumulate(e + offset)
    before = np.empty_like(reach)
    before[0] = -np.inf
    before[1:] = reach[:-1]
    before[np.r_[True, g[1:] != g[:-1]]] = -np.inf
    added = reach - np.maximum(s + offset, before)
    return np.bincount(g, weights=np.maximum(added, 0.0), minlength=n)
