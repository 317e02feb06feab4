"""What was slow, by name: the slowest requests of a step with the event that made each long,
and, over all steps, single spans far above their own event's usual time (a reward that took
40 s where it takes 30 ms) that a step total or a share would hide."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from skip_plugin_profiling.evidence import MIN_COUNT
from skip_plugin_profiling.frame import Frame, Requests
from skip_plugin_profiling.intervals import union_length
from skip_plugin_profiling.results import EventOutliers, SlowRequest

#: A span is an outlier of its event when its time (per generated token where the event's spans
#: all have ``tokens_out``) exceeds both the event's median + OUTLIER_MADS × MAD (MAD at least
#: MAD_FLOOR × median) and OUTLIER_RATIO × median, and its duration exceeds what the median
#: gives for it by over OUTLIER_MIN_S; judged among at least OUTLIER_MIN_SPANS spans of the event
#: (a median of fewer is no "usual": ``evidence.MIN_COUNT``).
OUTLIER_MADS, OUTLIER_RATIO, OUTLIER_MIN_S, OUTLIER_MIN_SPANS, MAD_FLOOR = 10.0, 5.0, 0.5, MIN_COUNT, 0.05
#: Events whose length is another's doing: a barrier wait is long because someone else was slow.
NOT_JUDGED = ("barrier_wait",)
_CORE = {"step", "phase", "workid", "event", "raw_event", "start", "end", "duration", "request_id", "turn"}
_CORE |= {"span_id", "parent_id", "pid", "file"}


def slowest_requests(fr: Frame, step: int | None, top: int) -> list[SlowRequest]:
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


def _slow_request(req: Requests, r: int, rid: str, events: list[dict], containers: set[str]) -> SlowRequest:
    origin = req.start[r]
    rows = []
    for e in sorted(events, key=lambda e: (e["start"], -e["end"])):
        rows.append(
            {
                "event": e["event"],
                "turn": e["turn"],
                "start": e["start"] - origin,
                "end": e["end"] - origin,
                "duration": e["end"] - e["start"],
                "attrs": {k: v for k, v in e.items() if v is not None and k not in _CORE},
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
    """The event name whose spans cover the most of the request (union: parallel spans once).
    Containers (the request itself, its turns) are left out by the caller: they cover it all."""
    best: tuple[str | None, float, int] = (None, 0.0, 0)
    for name in dict.fromkeys(r["event"] for r in rows):
        spans = [(r["start"], r["end"]) for r in rows if r["event"] == name]
        starts, ends = (np.array(x) for x in zip(*spans, strict=True))
        covered = float(union_length(np.zeros(len(spans), int), starts, ends, 1)[0])
        if covered > best[1]:
            best = (name, covered, len(spans))
    return best


def event_outliers(fr: Frame) -> EventOutliers:
    """Per leaf event, the spans far above that event's usual time (rule: ``OUTLIER_*``).

    The median and MAD are robust to the outliers they judge; the ratio keeps a tight event
    (MAD near zero) from flagging its ordinary jitter, and the absolute floor keeps micro-second
    events from being news at all. An event whose spans all carry ``tokens_out`` (an engine
    call) is judged per generated token: a long answer is the long tail's business, a slow
    token is news.
    """
    judged = fr.leaf & ~np.isin(fr.event, [fr.code(name) for name in NOT_JUDGED])
    duration, tokens = fr.end - fr.start, fr.column("tokens_out")
    rows_out, usual_out, medians, counts, per_token, unjudged = [], [], {}, {}, {}, {}
    for code in np.unique(fr.event[judged]).tolist():
        rows = np.flatnonzero(judged & (fr.event == code))
        if len(rows) < OUTLIER_MIN_SPANS:
            unjudged[fr.names[code]] = len(rows)
            continue
        name, d = fr.names[code], duration[rows]
        per_token[name] = bool((tokens[rows] > 0).all())
        size = tokens[rows] if per_token[name] else np.ones(len(rows))
        value = d / size
        median = float(np.median(value))
        mad = max(float(np.median(np.abs(value - median))), MAD_FLOOR * median)
        usual = median * size  # what a span of this size usually takes
        out = (value > median + OUTLIER_MADS * mad) & (value > OUTLIER_RATIO * median) & (d - usual > OUTLIER_MIN_S)
        medians[name], counts[name] = float(np.median(d)), len(rows)
        rows_out.append(rows[out])
        usual_out.append(usual[out])
    rows, usual = (np.concatenate(x) if x else np.zeros(0) for x in (rows_out, usual_out))
    return EventOutliers(_outlier_table(fr, rows.astype(np.int64), usual), medians, counts, per_token, unjudged)


def _outlier_table(fr: Frame, rows: np.ndarray, usual: np.ndarray) -> pa.Table:
    picked = fr.table.take(pa.array(rows, pa.int64()))
    duration = fr.end[rows] - fr.start[rows]
    table = pa.table(
        {
            "event": picked["event"],
            "raw_event": picked["raw_event"],
            "request_id": picked["request_id"],
            "step": picked["step"],
            "workid": picked["workid"],
            "turn": picked["turn"],
            "duration": pa.array(duration, pa.float64()),
            "usual": pa.array(usual, pa.float64()),
            "ratio": pa.array(np.divide(duration, usual, out=np.full(len(rows), np.inf), where=usual > 0)),
            "excess": pa.array(duration - usual, pa.float64()),
        }
    )
    return table.sort_by([("excess", "descending")]).drop_columns("excess")
