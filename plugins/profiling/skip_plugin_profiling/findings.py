"""The plain sentences a report opens with, most actionable first, each carrying the values
it names so tests and tools need not parse prose. Durations and shares go through ``units``
so a 40 µs tool call never reads "0.0 s".

A sentence that compares (a ratio, a share of a step's requests) names how many requests or
steps back each side; one whose smaller side is too thin to stand (``evidence``) is not
stated, and a ``left_out`` finding, after the others, says what was left out and why.
"""

from __future__ import annotations

import math

from skip_plugin_profiling.evidence import MIN_COUNT, MIN_STEPS, sides
from skip_plugin_profiling.results import Analysis, Finding
from skip_plugin_profiling.units import duration, share
from skip_plugin_profiling.workers import OTHER

#: At most this many event types get an outlier sentence, naming at most this many spans each.
OUTLIER_EVENTS, OUTLIER_NAMED = 3, 3


def describe(a: Analysis) -> list[Finding]:
    found: list[Finding] = []
    for make in (_read, _tail, _peaks, _straggler, _gaps, _slowest, _outliers, _shares, _turns, _advisor):
        found.extend(make(a))
    return sorted(found, key=lambda f: f.kind == "left_out")


def _read(a: Analysis) -> list[Finding]:
    if not a.lines_skipped:
        return []
    text = f"{a.lines_skipped} log lines could not be read (truncated or not JSON) and were skipped."
    return [Finding("skipped_lines", text, values={"lines": a.lines_skipped})]


def _tail(a: Analysis) -> list[Finding]:
    """The first 80% of a step's requests against its last 20%: the smaller side needs
    ``MIN_COUNT`` requests, so only steps with that many after their 80% point count."""
    c = a.completion
    rows = c.table.to_pylist()
    if not rows:
        return []
    if c.headline_pct is None:
        most = max(r["requests"] for r in rows)
        text = (
            f"The long tail is not stated: no step had {MIN_COUNT} requests in its last 20% (the most requests "
            f"in a step: {most}), and a share of fewer moves with a single request."
        )
        return [Finding("left_out", text, values={"finding": "long_tail", "requests": most})]
    backed = [r for r in rows if r["step"] in c.backed]
    last = sum(int((c.curves[r["step"]] > r["t80_s"]).sum()) for r in backed)
    first = sum(r["requests"] for r in backed) - last
    left = len(rows) - len(backed)
    skipped = f"; {_plural(left, 'step')} with fewer than {MIN_COUNT} requests in the last 20% left out" if left else ""
    text = (
        f"80% of requests completed within the first {c.headline_pct:.0f}% of the rollout; the last 20% took the "
        f"remaining {100 - c.headline_pct:.0f}% (median over {_plural(len(backed), 'step')}; "
        f"{sides(first, last, 'requests')}{skipped})."
    )
    values = {"steps": len(backed), "left_out_steps": left, "requests": (first, last)}
    return [Finding("long_tail", text, share=c.headline_pct / 100, values=values)]


def _peaks(a: Analysis) -> list[Finding]:
    """One step against the median of the steps: that median needs ``MIN_STEPS`` steps."""
    r = a.rollout
    out = []
    times = dict(zip(r.table["step"].to_pylist(), r.table["rollout_time"].to_pylist(), strict=True))
    n = len(times)
    for step in r.peaks:
        ratio = times[step] / r.median
        text = (
            f"Step {step}'s rollout took {duration(times[step])}, {ratio:.1f}× the median {duration(r.median)} "
            f"({sides(1, n, 'steps')}; threshold {duration(r.threshold)})."
        )
        values = {"median": r.median, "steps": n}
        out.append(Finding("peak", text, step=step, seconds=times[step], ratio=ratio, values=values))
    if r.left_out:
        named = ", ".join(f"step {s} ({times[s] / r.median:.1f}×)" for s in r.left_out)
        text = (
            f"No peak is named: {named} took longer than the median of the {_plural(n, 'step')} by more than the "
            f"threshold, but a median of fewer than {MIN_STEPS} steps is no baseline."
        )
        out.append(Finding("left_out", text, values={"finding": "peak", "steps": n, "left_out": r.left_out}))
    return out


def _straggler(a: Analysis) -> list[Finding]:
    """Named from who waited for whom; with a single worker there is nobody to compare."""
    w = a.workers
    if w is None or w.balanced is None:
        return []
    n = w.table.num_rows
    values = {"lag": w.lag, "mean_wait": w.mean_wait_others, "max_wait": w.max_wait_others, "threshold": w.threshold}
    if w.balanced:
        text = (
            f"On step {w.step} the {n} rollout workers finished together: the others waited {duration(w.lag)} "
            f"longer than the last to finish (median; a straggler needs over {duration(w.threshold)})."
        )
        return [Finding("balanced", text, step=w.step, seconds=w.lag, values=values)]
    finish = dict(zip(w.table["workid"].to_pylist(), w.table["finish"].to_pylist(), strict=True))[w.straggler]
    text = (
        f"On step {w.step}, worker {w.straggler} was the straggler: its last request finished "
        f"{duration(finish)} into the rollout, and the other {n - 1} workers waited for it at the barrier "
        f"{duration(w.mean_wait_others)} on average (at most {duration(w.max_wait_others)})."
    )
    return [Finding("straggler", text, step=w.step, worker=w.straggler, seconds=w.lag, values=values)]


def _gaps(a: Analysis, top: int = 3) -> list[Finding]:
    w = a.workers
    if w is None:
        return []
    out = []
    for row in w.table.to_pylist():
        if row["gap_flagged"]:
            text = (
                f"No request finished on worker {row['workid']} for {duration(row['gap'])} "
                f"(from {duration(row['gap_from'])} to {duration(row['gap_to'])} into step {w.step}'s rollout)."
            )
            values = {"from": row["gap_from"], "to": row["gap_to"], "threshold": row["gap_threshold"]}
            out.append(Finding("gap", text, step=w.step, worker=row["workid"], seconds=row["gap"], values=values))
    return sorted(out, key=lambda f: -(f.seconds or 0))[:top]


def _slowest(a: Analysis) -> list[Finding]:
    if not a.slowest:
        return []
    r = a.slowest[0]
    text = f"The slowest request of step {r.step}, {r.request_id} on worker {r.workid}, took {duration(r.duration)}"
    if r.dominant_event:
        spans = f" over {r.dominant_count} spans" if r.dominant_count > 1 else ""
        part = share(r.dominant_seconds / r.duration) if r.duration > 0 else "n/a"
        text += f"; {r.dominant_event} took {duration(r.dominant_seconds)} of it{spans} ({part})"
    values = {"event_seconds": r.dominant_seconds, "spans": r.dominant_count}
    fraction = r.dominant_seconds / r.duration if r.duration > 0 else None
    return [
        Finding(
            "slow_request",
            text + ".",
            step=r.step,
            worker=r.workid,
            request_id=r.request_id,
            event=r.dominant_event,
            seconds=r.duration,
            share=fraction,
            values=values,
        )
    ]


def _outliers(a: Analysis) -> list[Finding]:
    """One sentence per event type with outliers (the largest first), naming the worst spans."""
    o = a.outliers
    rows = o.table.to_pylist()
    out = []
    for event in list(dict.fromkeys(r["event"] for r in rows))[:OUTLIER_EVENTS]:
        mine = [r for r in rows if r["event"] == event]
        worst, median = mine[0], o.medians[event]
        basis = ", per generated token" if o.per_token[event] else ""
        named = "; ".join(_outlier(r) for r in mine[:OUTLIER_NAMED])
        more = f"; and {len(mine) - OUTLIER_NAMED} more" if len(mine) > OUTLIER_NAMED else ""
        text = (
            f"{len(mine)} of {o.spans[event]} {_label(worst)} spans took far longer than usual (the median of the "
            f"{o.spans[event]}{basis}): {named}{more}."
        )
        values = {"median": median, "count": len(mine), "spans": o.spans[event], "outliers": mine}
        out.append(
            Finding(
                "event_outlier",
                text,
                step=worst["step"],
                worker=worst["workid"],
                request_id=worst["request_id"],
                event=event,
                seconds=worst["duration"],
                ratio=worst["ratio"],
                values=values,
            )
        )
    return out


def _outlier(row: dict) -> str:
    who = f"request {row['request_id']}, " if row["request_id"] else ""
    where = f"{who}step {row['step']}, worker {row['workid']}"
    return f"{duration(row['duration'])} against a usual {duration(row['usual'])} ({where})"


def _label(row: dict) -> str:
    """Our event name, and the logger's own where it differs (the article's ``calc_reward``)."""
    raw = row.get("raw_event")
    return row["event"] if not raw or raw == row["event"] else f"{row['event']} (logged as {raw})"


def _shares(a: Analysis, top: int = 3) -> list[Finding]:
    """One sentence whose parts add up: the top events and the rest of the same whole."""
    rows = [r for r in a.shares.table.to_pylist() if r["event"] != OTHER and r["mean_share"] > 0]
    if not rows:
        return []
    shown = rows[:top]
    rest = max(0.0, 1.0 - sum(r["mean_share"] for r in shown))
    parts = ", ".join(f"{r['event']} {share(r['mean_share'])} ({duration(r['mean_seconds'])})" for r in shown)
    text = (
        f"Of a rollout worker's step (busy + barrier wait, averaged over {_plural(a.shares.pairs, 'worker-step')}, "
        f"concurrent spans sharing each instant): {parts}; everything else, other events and idle time, "
        f"{share(rest)}."
    )
    values = {"shares": {r["event"]: r["mean_share"] for r in shown}, "rest": rest}
    return [Finding("event_share", text, event=shown[0]["event"], share=shown[0]["mean_share"], values=values)]


def _turns(a: Analysis) -> list[Finding]:
    """The most turns against the fewest, among turn counts with ``MIN_COUNT`` requests."""
    rows = [r for r in a.turns.by_count.to_pylist() if r["turns"] > 0]
    if len(rows) < 2:
        return []
    enough = [r for r in rows if r["requests"] >= MIN_COUNT]
    out = []
    if len(enough) >= 2:
        lo, hi = enough[0], enough[-1]
        ratio = hi["mean_duration"] / lo["mean_duration"] if lo["mean_duration"] > 0 else math.nan
        text = (
            f"Requests with {hi['turns']} turns took {duration(hi['mean_duration'])} on average, {ratio:.1f}× those "
            f"with {_plural(lo['turns'], 'turn')} ({duration(lo['mean_duration'])}; "
            f"{sides(hi['requests'], lo['requests'], 'requests')})."
        )
        values = {"turns": hi["turns"], "baseline_turns": lo["turns"], "requests": (hi["requests"], lo["requests"])}
        out.append(Finding("turns", text, ratio=ratio, values=values))
    few = [r for r in rows if r["requests"] < MIN_COUNT]
    if few:
        listed = ", ".join(f"{_plural(r['turns'], 'turn')} (n={r['requests']})" for r in few)
        text = (
            f"Request time is not compared for requests with {listed}: a ratio needs at least {MIN_COUNT} "
            f"requests on each side."
        )
        values = {"finding": "turns", "requests": {r["turns"]: r["requests"] for r in few}}
        out.append(Finding("left_out", text, values=values))
    return out


def _advisor(a: Analysis) -> list[Finding]:
    out = []
    t = a.tail
    caps = [r for r in t.caps.to_pylist() if r["truncated_share"] <= 0.05 and r["saved_s"] > 0]
    if caps:
        best = max(caps, key=lambda r: r["saved_s"])
        text = (
            f"Capping max_response_length at {best['length']} tokens would truncate "
            f"{share(best['truncated_share'])} of requests ({best['truncated']} of the {t.with_tokens} with token "
            f"counts) and save an estimated {duration(best['saved_s'])} ({share(best['saved_pct'] / 100)}) of "
            f"the rollouts' {duration(t.total_rollout)}."
        )
        values = {"length": best["length"], "truncated_share": best["truncated_share"]}
        out.append(Finding("tail_cap", text, seconds=best["saved_s"], share=best["saved_pct"] / 100, values=values))
    over = [r for r in t.oversample.to_pylist() if r["saved_s"] > 0]
    if over:
        best = max(over, key=lambda r: r["saved_s"] / max(r["extra_requests_pct"], 1e-9))
        text = (
            f"Launching {best['extra_requests_pct']:.0f}% more requests and dropping the slowest {best['drop']:.0%} "
            f"of each step ({best['dropped']} of the {t.requests} here) would save an estimated "
            f"{duration(best['saved_s'])} ({share(best['saved_pct'] / 100)}) of the rollouts' "
            f"{duration(t.total_rollout)}; the extra requests could add up to {duration(best['extra_time_s'])} "
            f"if the engines are saturated."
        )
        values = {
            "drop": best["drop"],
            "dropped": best["dropped"],
            "extra_requests_pct": best["extra_requests_pct"],
            "extra_time_s": best["extra_time_s"],
        }
        out.append(Finding("oversample", text, seconds=best["saved_s"], share=best["saved_pct"] / 100, values=values))
    return out


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
