"""Step-level shape of the rollouts: when requests completed (the long tail), which steps
were peaks, and how turns spread the work, as in the article's CDF, overview and turn plots."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from skip_plugin_profiling.evidence import MIN_COUNT, MIN_STEPS
from skip_plugin_profiling.frame import Frame, ints
from skip_plugin_profiling.results import Completion, RolloutTimes, Turns

QUANTILES = (0.5, 0.8, 0.95, 0.99)
#: A step is a peak when its rollout time exceeds median + PEAK_MADS × MAD and PEAK_RATIO × median.
PEAK_MADS, PEAK_RATIO, MAD_FLOOR = 3.0, 1.25, 0.05


def completion(fr: Frame) -> Completion:
    req, steps = fr.requests, fr.steps
    columns: dict[str, list] = {"step": [], "requests": [], "rollout_time": []}
    for q in QUANTILES:
        columns[f"t{round(q * 100)}_s"], columns[f"t{round(q * 100)}_pct"] = [], []
    curves, backed = {}, []
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
        if (done > columns["t80_s"][-1]).sum() >= MIN_COUNT:  # the last 20% is the smaller side
            backed.append(step)
    pct80 = [p for s, p in zip(columns["step"], columns["t80_pct"], strict=True) if s in backed]
    headline = float(np.median(pct80)) if pct80 else None
    return Completion(pa.table(columns), curves, headline, backed)


def rollout_times(fr: Frame) -> RolloutTimes:
    steps = fr.steps
    times = steps.rollout_time
    if not len(times):
        empty = pa.table({"step": pa.array([], pa.int64()), "rollout_time": pa.array([], pa.float64())})
        return RolloutTimes(empty, math.nan, math.nan, math.nan, [])
    median = float(np.median(times))
    mad = max(float(np.median(np.abs(times - median))), MAD_FLOOR * median)
    threshold = max(median + PEAK_MADS * mad, PEAK_RATIO * median)
    above = times > threshold
    peak = above & (len(times) >= MIN_STEPS)
    table = pa.table(
        {"step": steps.ids, "rollout_time": times, "ratio": times / median if median > 0 else times * 0, "peak": peak}
    )
    return RolloutTimes(table, median, mad, threshold, steps.ids[peak].tolist(), steps.ids[above & ~peak].tolist())


def chosen_step(fr: Frame, step: int | None) -> int | None:
    """The step to look at in detail: ``step`` if it has rollout events, else the slowest."""
    steps = fr.steps
    if step is None:
        return int(steps.ids[np.argmax(steps.rollout_time)]) if len(steps.ids) else None
    if step not in steps.ids.tolist():
        available = ", ".join(map(str, steps.ids.tolist())) or "none"
        raise ValueError(f"step {step} has no rollout events in phase {fr.phase!r}; steps available: {available}")
    return int(step)


def turns(fr: Frame) -> Turns:
    req = fr.requests
    gen = np.flatnonzero(fr.is_event("generate") & (req.index >= 0))
    by_turn = _mean_by(
        {"step": fr.step[gen], "turn": _turn_index(fr, gen)}, fr.end[gen] - fr.start[gen], "mean_generate", "calls"
    ).sort_by([("step", "ascending"), ("turn", "ascending")])
    by_count = _mean_by({"turns": req.turns}, req.duration, "mean_duration", "requests").sort_by("turns")
    distribution = _mean_by({"step": req.step, "turns": req.turns}, req.duration, "_", "requests").drop_columns("_")
    per_step = dict(zip(*np.unique(req.step, return_counts=True), strict=True))
    steps = distribution["step"].to_pylist()
    distribution = distribution.append_column(
        "share", pa.array([c / per_step[s] for s, c in zip(steps, distribution["requests"].to_pylist(), strict=True)])
    ).sort_by([("step", "ascending"), ("turns", "ascending")])
    return Turns(by_turn, by_count, distribution)


def _turn_index(fr: Frame, gen: np.ndarray) -> np.ndarray:
    """The logged 1-based ``turn`` when every call has one, else the call's rank by start
    within its request: the article's logger counts turns from 0 and leaves some calls
    without one, and mixing the two would put two calls of a request on one turn."""
    logged = ints(fr.table, "turn", -1)[gen]
    if (logged > 0).all():
        return logged
    req = fr.requests.index[gen]
    order = np.lexsort((fr.start[gen], req))
    ranked = np.empty(len(gen), np.int64)
    sorted_req = req[order]
    first = np.r_[0, np.flatnonzero(np.diff(sorted_req)) + 1] if len(gen) else np.zeros(0, int)
    starts = np.repeat(first, np.diff(np.r_[first, len(gen)]))
    ranked[order] = np.arange(len(gen)) - starts + 1
    return ranked


def _mean_by(keys: dict[str, np.ndarray], values: np.ndarray, mean: str, count: str) -> pa.Table:
    table = pa.table({**keys, "v": values}).group_by(list(keys)).aggregate([("v", "mean"), ("v", "count")])
    return table.select([*keys, "v_mean", "v_count"]).rename_columns([*keys, mean, count])
