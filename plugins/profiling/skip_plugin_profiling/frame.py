"""One phase's events as numpy columns, and the per-step, per-request and per-worker
aggregates every analysis shares, each computed at most once.

The analyses are vectorized over these columns: a million events take seconds. Times are
seconds; "relative" times count from the step's ``t0``, the first start of any rollout-side
event (``workid >= 0``) of that step.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from skip_plugin_profiling import article
from skip_plugin_profiling.columns import cast
from skip_plugin_profiling.intervals import group_reduce, union_length
from skip_plugin_profiling.logs import Logs

#: Spans that hold other spans: counting them beside their children would count time twice.
CONTAINERS = frozenset({"rollout", "request", "turn"}) | article.CONTAINERS
#: A worker's ``weight_sync`` loads the next rollout's weights after the step trained.
OUTSIDE_ROLLOUT = ("weight_sync",)


class Frame:
    """numpy views of one phase's events; the aggregates below hang off it, lazily."""

    def __init__(self, table: pa.Table, phase: str) -> None:
        self.table, self.phase = table, phase
        self.n = table.num_rows
        self.step = ints(table, "step")
        self.workid = ints(table, "workid")
        self.start = floats(table, "start")
        self.end = np.maximum(floats(table, "end"), self.start)
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
        return floats(self.table, name)

    @cached_property
    def side(self) -> np.ndarray:
        """Rollout-side events: a rollout worker's, or the driver's about one (barrier waits).
        A worker's ``weight_sync`` would stretch the rollout over the whole training step."""
        outside = np.isin(self.event, [self.code(name) for name in OUTSIDE_ROLLOUT])
        return (self.workid >= 0) & ~outside

    @cached_property
    def containers(self) -> list[str]:
        return _containers(self)

    @cached_property
    def leaf(self) -> np.ndarray:
        """Rollout-side events that are not containers: the ones whose time is their own."""
        held = np.isin(self.event, [self.code(c) for c in self.containers])
        return self.side & ~held & (self.event >= 0)

    @cached_property
    def steps(self) -> Steps:
        return Steps(self)

    @cached_property
    def requests(self) -> Requests:
        return Requests(self)

    @cached_property
    def pairs(self) -> Pairs:
        return Pairs(self)


class Steps:
    """Steps with rollout-side events: t0, end and rollout time."""

    def __init__(self, fr: Frame) -> None:
        steps = np.unique(fr.step[fr.side])
        self.ids = steps
        idx = np.searchsorted(steps, fr.step[fr.side])
        self.t0 = group_reduce(idx, len(steps), fr.start[fr.side], "min")
        self.end = group_reduce(idx, len(steps), fr.end[fr.side], "max")
        self.rollout_time = self.end - self.t0

    def index(self, step: np.ndarray | int) -> np.ndarray:
        return np.searchsorted(self.ids, step)


class Requests:
    """One row per (step, request_id): who ran it, when, how many turns and tokens."""

    def __init__(self, fr: Frame) -> None:
        rows = np.flatnonzero((fr.rid >= 0) & fr.side)
        key = fr.step[rows] * (len(fr.rid_names) + 1) + fr.rid[rows]
        uniq, inv = np.unique(key, return_inverse=True)
        n = len(uniq)
        self.rows, self.of_row = rows, inv
        self.index = np.full(fr.n, -1)
        self.index[rows] = inv
        self.n = n
        self.step = group_reduce(inv, n, fr.step[rows], "max").astype(np.int64)
        self.workid = group_reduce(inv, n, fr.workid[rows], "min").astype(np.int64)
        self.rid = group_reduce(inv, n, fr.rid[rows], "max").astype(np.int64)
        self.start = group_reduce(inv, n, fr.start[rows], "min")
        self.end = group_reduce(inv, n, fr.end[rows], "max")
        self.duration = self.end - self.start
        t0 = fr.steps.t0[fr.steps.index(self.step)] if n else np.zeros(0)
        self.rel_start, self.rel_end = self.start - t0, self.end - t0
        self._generate(fr, rows, inv)
        self._attributes(fr, rows, inv)

    def _generate(self, fr: Frame, rows: np.ndarray, inv: np.ndarray) -> None:
        gen = fr.is_event("generate")[rows]
        self.generates = np.bincount(inv, weights=gen, minlength=self.n).astype(np.int64)
        # the union, not the sum: calls of one request that overlap (a logger timing one call
        # twice, parallel sampling) took their time once
        self.gen_time = union_length(inv[gen], fr.start[rows][gen], fr.end[rows][gen], self.n)
        tokens = fr.column("tokens_out")[rows]
        known = gen & ~np.isnan(tokens)
        summed = np.bincount(inv, weights=np.where(known, tokens, 0.0), minlength=self.n)
        self.tokens = np.where(np.bincount(inv, weights=known, minlength=self.n) > 0, summed, np.nan)

    def _attributes(self, fr: Frame, rows: np.ndarray, inv: np.ndarray) -> None:
        turns = group_reduce(inv, self.n, fr.column("turns")[rows], "max")
        self.turns = np.where(np.isnan(turns), self.generates, turns).astype(np.int64)
        response = group_reduce(inv, self.n, fr.column("response_tokens")[rows], "max")
        self.tokens = np.where(np.isnan(self.tokens), response, self.tokens)

    def ids(self, fr: Frame, which: np.ndarray) -> list[str]:
        return pc.take(fr.rid_names, pa.array(self.rid[which], pa.int64())).to_pylist()


class Pairs:
    """One row per (step, rollout worker): busy time, barrier wait, their sum T, requests.

    busy: the worker's ``rollout`` span(s), or without one the stretch from its first start to
    its last end, less any barrier wait they overlap: the article's ``total_step_duration``
    and its events after the barrier (broadcast, padding) include the wait, our ``rollout``
    does not, and subtracting the overlap is right for both. wait: its ``barrier_wait`` spans;
    without them, the step's last end minus the worker's last end.
    """

    def __init__(self, fr: Frame) -> None:
        side = np.flatnonzero(fr.side)
        key = fr.step[side] * (fr.workid.max(initial=0) + 1) + fr.workid[side]
        uniq, inv = np.unique(key, return_inverse=True)
        self.n = n = len(uniq)
        self.index = np.full(fr.n, -1)
        self.index[side] = inv
        self.step = group_reduce(inv, n, fr.step[side], "max").astype(np.int64)
        self.workid = group_reduce(inv, n, fr.workid[side], "max").astype(np.int64)
        barrier, rollout = fr.is_event("barrier_wait")[side], fr.is_event("rollout")[side]
        own = ~barrier
        s, e = fr.start[side], fr.end[side]
        self.first = group_reduce(inv[own], n, s[own], "min")
        self.last = group_reduce(inv[own], n, e[own], "max")
        wait = union_length(inv[barrier], s[barrier], e[barrier], n)
        both = barrier | rollout
        stretch = np.flatnonzero((np.bincount(inv[rollout], minlength=n) == 0) & ~np.isnan(self.first))
        outer = (np.r_[inv[both], stretch], np.r_[s[both], self.first[stretch]], np.r_[e[both], self.last[stretch]])
        self.busy = union_length(*outer, n) - wait
        measured = np.bincount(inv[barrier], minlength=n) > 0
        steps, of_step = np.unique(self.step, return_inverse=True)
        step_last = group_reduce(of_step, len(steps), self.last, "max")[of_step]
        self.wait = np.where(measured, wait, np.nan_to_num(np.maximum(step_last - self.last, 0.0)))
        self.total = self.busy + self.wait
        req = fr.requests
        first_rows = req.rows[np.unique(req.of_row, return_index=True)[1]] if req.n else np.zeros(0, int)
        req_pair = self.index[first_rows]
        self.requests = np.bincount(req_pair, minlength=n).astype(np.int64)


def _containers(fr: Frame) -> list[str]:
    """Names whose spans mostly have children, plus the known containers: a name is judged by
    majority so one odd nesting does not hide it. Span ids are unique within one process's
    file (``pid`` alone can repeat across nodes), so parents are looked up by (file, span id)."""
    names = set(CONTAINERS) & set(fr.names)
    source = "file" if "file" in fr.table.column_names and fr.table["file"].null_count == 0 else "pid"
    pid, span, parent = (ints(fr.table, c, -1) for c in (source, "span_id", "parent_id"))
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


def table_of(source: Logs | pa.Table) -> pa.Table:
    return source.table if isinstance(source, Logs) else source


def frame_of(source: Logs | pa.Table, phase: str | None) -> Frame:
    """The events of ``phase`` (default: train, else the first phase present)."""
    table = table_of(source)
    phases = sorted(pc.unique(table["phase"]).drop_null().to_pylist())
    phase = phase or ("train" if "train" in phases or not phases else phases[0])
    return Frame(table.filter(pc.fill_null(pc.equal(table["phase"], phase), False)), phase)


def floats(table: pa.Table, name: str) -> np.ndarray:
    """A column as float64, NaN where a value is missing or no finite number. Value by value: one
    line's ``"tokens_out": "many"`` makes the column text, and must not cost the other lines theirs."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    values = pc.fill_null(cast(table[name], pa.float64(), table.num_rows), np.nan).to_numpy()
    return np.where(np.isfinite(values), values, np.nan)


def ints(table: pa.Table, name: str, fill: int = 0) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, fill, np.int64)
    return pc.fill_null(table[name].cast(pa.int64()), fill).to_numpy()
