"""Grouped interval arithmetic on numpy arrays: per-group min/max, union length, shared time.

The analyses ask the same few questions of millions of spans at once ("how long was this
worker covered by generate spans", "which part of this second belongs to each of the spans
open in it"); each answer here is one or two sorted passes, never a Python loop over spans.
"""

from __future__ import annotations

import numpy as np


def group_reduce(groups: np.ndarray, n: int, values: np.ndarray, how: str) -> np.ndarray:
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


def union_length(groups: np.ndarray, starts: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
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


def shared_time(groups: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per interval, its part of its group's covered time when every instant is split evenly
    among the intervals open at it.

    A worker runs many requests at once, so "seconds of generate" and "seconds of tool calls"
    overlap and their shares of the worker's time would add up past 100%. Split this way the
    parts of a group sum to exactly its union length, and each event's share is a share of
    one whole. With n(t) intervals open at t, an interval gets the integral of 1/n(t) over its
    own extent: the difference of one running integral at its end and at its start.
    """
    m = len(groups)
    if not m:
        return np.zeros(0)
    ends = np.maximum(ends, starts)
    times = np.concatenate([starts, ends])
    owner = np.concatenate([groups, groups])
    delta = np.concatenate([np.ones(m), -np.ones(m)])
    order = np.lexsort((-delta, times, owner))  # within a group by time; at a tie, opens first
    t, g = times[order], owner[order]
    open_after = np.cumsum(delta[order])  # each group's deltas sum to zero: no reset needed
    dt = np.diff(t, append=t[-1])
    dt[np.r_[g[1:] != g[:-1], True]] = 0.0  # no segment runs from one group into the next
    rate = np.divide(1.0, open_after, out=np.zeros(2 * m), where=open_after > 0)
    integral = np.concatenate([[0.0], np.cumsum(rate * dt)])[:-1]
    at = np.empty(2 * m)
    at[order] = integral
    return at[m:] - at[:m]
