"""The tail advisor: what capping the response length, or oversampling and keeping the first
finishers, would have saved of these rollouts, as the article weighed before cutting its
max response length. Estimates from the logged requests, with their assumptions stated."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from skip_plugin_profiling.frame import Frame, Requests
from skip_plugin_profiling.intervals import group_reduce
from skip_plugin_profiling.results import TailAdvice

TOKEN_PERCENTILES = (50, 80, 90, 95, 99)
DROPS = (0.05, 0.10, 0.20)


def tail_advice(fr: Frame, lengths: tuple[int, ...] | list[int] = (), drops: tuple[float, ...] = DROPS) -> TailAdvice:
    req, steps = fr.requests, fr.steps
    step_idx = steps.index(req.step) if req.n else np.zeros(0, int)
    base = group_reduce(step_idx, len(steps.ids), req.rel_end, "max")
    total = float(np.nansum(steps.rollout_time))
    caps, note = _caps(req, step_idx, base, len(steps.ids), total, lengths)
    over = _oversample(req, step_idx, base, len(steps.ids), total, drops)
    return TailAdvice(caps, over, total, note=note)


def _caps(req: Requests, step_idx, base, n_steps, total, lengths) -> tuple[pa.Table, str]:
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
        capped = group_reduce(step_idx, n_steps, req.rel_start + np.maximum(req.duration - cut, 0.0), "max")
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


def _oversample(req: Requests, step_idx, base, n_steps, total, drops) -> pa.Table:
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
