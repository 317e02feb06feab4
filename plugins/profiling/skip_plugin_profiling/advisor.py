"""The tail advisor: what capping the response length, or oversampling and keeping the first
finishers, would have saved of these rollouts, as the article weighed before cutting its
max response length. Estimates from the logged requests, with their assumptions stated.

Every estimate is taken on the wall clock, never on summed spans: a worker runs many
requests at once, so their seconds add up to many times the rollout's, and an async
schedule rolls out one step's samples while another step's are still running. A step's
rollout is its window on the timeline; a saving is what the union of the windows loses
when a window ends earlier, so no estimate exceeds the time the timeline holds.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from skip_plugin_profiling.frame import Frame, Requests
from skip_plugin_profiling.intervals import group_reduce, union_length
from skip_plugin_profiling.results import TailAdvice

TOKEN_PERCENTILES = (50, 80, 90, 95, 99)
DROPS = (0.05, 0.10, 0.20)


class Timeline:
    """The steps' rollout windows [t0, end] and when each step's last request ended (from t0).
    Ending a step's last request earlier ends its window earlier by as much: the work after
    it (padding, the barrier) is left as it was."""

    def __init__(self, t0: np.ndarray, end: np.ndarray, last: np.ndarray) -> None:
        self.t0, self.end, self.last = t0, end, last
        self.wall = self._union(end)

    def saved(self, last: np.ndarray) -> float:
        """Wall time saved if each step's last request ended at ``last`` (from its t0)."""
        earlier = np.nan_to_num(np.maximum(self.last - last, 0.0))
        return self.wall - self._union(self.end - earlier)

    def _union(self, end: np.ndarray) -> float:
        return float(union_length(np.zeros(len(self.t0), np.intp), self.t0, end, 1)[0])


def tail_advice(fr: Frame, lengths: tuple[int, ...] | list[int] = (), drops: tuple[float, ...] = DROPS) -> TailAdvice:
    req, steps = fr.requests, fr.steps
    step_idx = steps.index(req.step) if req.n else np.zeros(0, int)
    timeline = Timeline(steps.t0, steps.end, group_reduce(step_idx, len(steps.ids), req.rel_end, "max"))
    caps, note = _caps(req, step_idx, timeline, lengths)
    over = _oversample(req, step_idx, timeline, drops, _generating(fr))
    known = int((~np.isnan(req.tokens) & (req.tokens > 0)).sum())
    return TailAdvice(caps, over, timeline.wall, requests=req.n, with_tokens=known, note=note)


def _caps(req: Requests, step_idx, timeline: Timeline, lengths) -> tuple[pa.Table, str]:
    """Each request loses (tokens - L) × its own seconds per generated token when over L."""
    tokens = req.tokens
    known = ~np.isnan(tokens) & (tokens > 0)
    if not known.any():
        return _CAPS_SCHEMA.empty_table(), "no token counts (tokens_out / response_tokens) in the logs"
    gen_time = np.where(req.gen_time > 0, req.gen_time, np.nan)
    per_token = np.where(known, gen_time / np.where(known, tokens, 1), np.nan)
    candidates = {_round2(np.percentile(tokens[known], p)): f"p{p}" for p in TOKEN_PERCENTILES}
    for length in lengths:
        candidates[int(length)] = "given"
    rows: dict[str, list] = {name: [] for name in _CAPS_SCHEMA.names}
    for length, label in sorted(candidates.items()):
        over = known & (tokens > length)
        cut = np.where(over & ~np.isnan(per_token), (tokens - length) * np.nan_to_num(per_token), 0.0)
        ends = req.rel_start + np.maximum(req.duration - cut, 0.0)
        saved = timeline.saved(group_reduce(step_idx, len(timeline.t0), ends, "max"))
        rows["length"].append(length)
        rows["label"].append(label)
        rows["truncated"].append(int(over.sum()))
        rows["truncated_share"].append(float(over.sum() / known.sum()))
        rows["saved_s"].append(saved)
        rows["saved_pct"].append(_pct(saved, timeline.wall))
    return pa.table(rows, schema=_CAPS_SCHEMA), ""


_CAPS_SCHEMA = pa.schema(
    [
        ("length", pa.int64()),
        ("label", pa.string()),
        ("truncated", pa.int64()),
        ("truncated_share", pa.float64()),
        ("saved_s", pa.float64()),
        ("saved_pct", pa.float64()),
    ]
)


def _oversample(req: Requests, step_idx, timeline: Timeline, drops, generating: float) -> pa.Table:
    """Launch n/(1-x), keep the first n: a step ends when a (1-x) share of its requests is done.

    The extra requests are not free: with the engines saturated they stretch the time the
    engines were generating by their share (``extra_time_s``), an upper bound on what they
    add to the rollout, which is never more than the extra share of the rollout's wall time.
    """
    rows: dict[str, list] = {
        "drop": [],
        "dropped": [],
        "saved_s": [],
        "saved_pct": [],
        "extra_requests_pct": [],
        "extra_time_s": [],
    }
    n_steps = len(timeline.t0)
    for drop in drops:
        kept, dropped = np.full(n_steps, np.nan), 0
        for i in range(n_steps):
            done = req.rel_end[step_idx == i]
            if len(done):
                kept[i] = np.quantile(done, 1 - drop, method="inverted_cdf")
                dropped += int((done > kept[i]).sum())
        saved = timeline.saved(kept)
        extra = drop / (1 - drop)
        rows["drop"].append(float(drop))
        rows["dropped"].append(dropped)
        rows["saved_s"].append(saved)
        rows["saved_pct"].append(_pct(saved, timeline.wall))
        rows["extra_requests_pct"].append(100 * extra)
        rows["extra_time_s"].append(extra * generating)
    return pa.table(rows)


def _generating(fr: Frame) -> float:
    """Wall time with any engine call running (without engine calls, any request): what more
    requests stretch on saturated engines. Concurrent calls count once."""
    rows = np.flatnonzero(fr.side & fr.is_event("generate"))
    req = fr.requests
    starts, ends = (fr.start[rows], fr.end[rows]) if len(rows) else (req.start, req.end)
    return float(union_length(np.zeros(len(starts), np.intp), starts, ends, 1)[0])


def _pct(part: float, whole: float) -> float:
    return 100 * part / whole if whole > 0 else math.nan


def _round2(x: float) -> int:
    """Two significant digits: 1234 -> 1200, the kind of number one puts in a config."""
    if x < 10:
        return max(1, round(x))
    digits = math.floor(math.log10(x)) - 1
    return int(round(x, -digits))
