"""The rollout workers of a step side by side: who the others waited for at the barrier,
where a worker went long without finishing a request, and where each worker's time went."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from skip_plugin_profiling.frame import Frame
from skip_plugin_profiling.intervals import shared_time
from skip_plugin_profiling.results import EventShares, Workers

#: A gap between completions is flagged above max(GAP_MIN_S, GAP_FACTOR × median gap, GAP_ROLLOUT × rollout).
GAP_MIN_S, GAP_FACTOR, GAP_ROLLOUT = 10.0, 5.0, 0.20
#: A straggler is named when the others waited longer than it by over max(LAG_MIN_S, LAG_ROLLOUT × rollout).
LAG_MIN_S, LAG_ROLLOUT = 1.0, 0.10
#: The row of the event shares for time no leaf span covered.
OTHER = "other/idle"


def workers(fr: Frame, step: int | None) -> Workers | None:
    if step is None:
        return None
    pairs, req, steps = fr.pairs, fr.requests, fr.steps
    rows = np.flatnonzero(pairs.step == step)
    rows = rows[np.argsort(pairs.workid[rows])]
    t0 = steps.t0[steps.index(step)]
    rollout = float(steps.rollout_time[steps.index(step)])
    completions, gaps, finish = {}, [], []
    for p in rows.tolist():
        done = np.sort(req.rel_end[(req.step == step) & (req.workid == pairs.workid[p])])
        completions[int(pairs.workid[p])] = done
        gaps.append(_largest_gap(done, rollout))
        finish.append(float(done[-1]) if len(done) else float(pairs.last[p] - t0))
    table = pa.table(
        {
            "workid": pairs.workid[rows],
            "busy": pairs.busy[rows],
            "wait": pairs.wait[rows],
            "total": pairs.total[rows],
            "requests": pairs.requests[rows],
            "finish": pa.array(finish, pa.float64()),
            "gap": pa.array([g[0] for g in gaps], pa.float64()),
            "gap_from": pa.array([g[1] for g in gaps], pa.float64()),
            "gap_to": pa.array([g[2] for g in gaps], pa.float64()),
            "gap_threshold": pa.array([g[3] for g in gaps], pa.float64()),
            "gap_flagged": pa.array([g[0] > g[3] for g in gaps], pa.bool_()),
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
    """The straggler is whom the others waited for: the least barrier wait, then the latest
    finish. Busy times cannot tell: a worker's busy span may include idling for others."""
    wait, finish = table["wait"].to_numpy(), table["finish"].to_numpy()
    ids = table["workid"].to_numpy()
    threshold = max(LAG_MIN_S, LAG_ROLLOUT * rollout)
    known = {"step": step, "rollout_time": rollout, "table": table, "threshold": threshold, "completions": completions}
    if len(ids) < 2:
        nothing = dict.fromkeys(("lag", "mean_wait_others", "max_wait_others"), math.nan)
        return Workers(**known, **nothing, straggler=None, balanced=None)
    s = int(np.lexsort((-finish, wait))[0])
    others = np.arange(len(ids)) != s
    lag = float(np.median(wait[others]) - wait[s])
    balanced = lag <= threshold
    return Workers(
        **known,
        straggler=None if balanced else int(ids[s]),
        lag=lag,
        mean_wait_others=float(wait[others].mean()),
        max_wait_others=float(wait[others].max()),
        balanced=balanced,
    )


def event_shares(fr: Frame) -> EventShares:
    """Per (step, worker), T = busy + barrier wait; each instant is split evenly among the leaf
    spans open at it (a worker runs many requests at once), so the events' shares of T add up
    to at most 100% and the rest is time no leaf span covered."""
    pairs = fr.pairs
    rows = np.flatnonzero(fr.leaf)
    n_events = len(fr.names)
    group = pairs.index[rows]
    part = shared_time(group, fr.start[rows], fr.end[rows])
    cell = group * n_events + fr.event[rows]
    # float even with no leaf span at all (a log of request spans only), where bincount gives ints
    seconds = np.bincount(cell, weights=part, minlength=pairs.n * n_events).astype(float).reshape(pairs.n, n_events)
    present = np.bincount(cell, minlength=pairs.n * n_events).reshape(pairs.n, n_events) > 0
    total = np.maximum(pairs.total, seconds.sum(axis=1))[:, None]  # spans past T must not push shares past 100%
    share = np.divide(seconds, total, out=np.zeros_like(seconds), where=total > 0)
    used = np.flatnonzero(present.any(axis=0))
    n = max(pairs.n, 1)
    table = pa.table(
        {
            "event": pa.array([fr.names[i] for i in used], pa.string()),  # typed when no event is used
            "mean_share": share[:, used].sum(axis=0) / n,
            "mean_seconds": seconds[:, used].sum(axis=0) / n,
            "pairs": present[:, used].sum(axis=0),
        }
    ).sort_by([("mean_share", "descending")])
    rest = pa.table(
        {
            "event": [OTHER],
            "mean_share": [max(0.0, 1.0 - float(share.sum(axis=1).mean()))] if pairs.n else [0.0],
            "mean_seconds": [float((total[:, 0] - seconds.sum(axis=1)).mean())] if pairs.n else [0.0],
            "pairs": [pairs.n],
        }
    )
    table = pa.concat_tables([table, rest.cast(table.schema)])
    return EventShares(table, _shares_per_step(fr, share, used), fr.containers, pairs.n)


def _shares_per_step(fr: Frame, share: np.ndarray, used: np.ndarray) -> pa.Table:
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
