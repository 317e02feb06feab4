"""A report a person reads once after a slow run: findings first, then each analysis with its
table and figure, as one self-contained ``index.html`` (and the same in ``report.md``).

Every string that came from the logs (event names, request ids, tool names) is escaped before
it reaches HTML; every duration goes through ``units.duration`` so each reads in a unit that
fits it, in sentences and table cells alike.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from skip_core import writing

from skip_plugin_profiling import units
from skip_plugin_profiling.analysis import Analysis, Finding, analyze, findings
from skip_plugin_profiling.evidence import MIN_COUNT, MIN_STEPS
from skip_plugin_profiling.figures import FIGURES, draw
from skip_plugin_profiling.logs import Logs
from skip_plugin_profiling.rollout import MAD_FLOOR, PEAK_MADS, PEAK_RATIO
from skip_plugin_profiling.slowest import OUTLIER_MADS, OUTLIER_MIN_S, OUTLIER_MIN_SPANS, OUTLIER_RATIO
from skip_plugin_profiling.workers import GAP_FACTOR, GAP_MIN_S, GAP_ROLLOUT, LAG_MIN_S, LAG_ROLLOUT, OTHER

__all__ = ["FIGURES", "write_report"]

_MAX_EVENT_ROWS = 40
_MAX_OUTLIER_ROWS = 25
#: Columns holding seconds, whatever the table; pivots and the trainer table name theirs.
_TIME_COLUMNS = frozenset(
    [
        "rollout_time",
        "busy",
        "wait",
        "total",
        "finish",
        "gap",
        "gap_from",
        "gap_to",
        "gap_threshold",
        "mean_seconds",
        "duration",
        "usual",
        "mean_generate",
        "mean_duration",
        "start",
        "end",
    ]
)


@dataclass
class _Table:
    caption: str
    headers: list[str]
    rows: list[list[str]]


@dataclass
class _Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[_Table] = field(default_factory=list)
    image: str | None = None


def write_report(
    logs: Logs,
    out_dir: str | os.PathLike,
    step: int | None = None,
    top: int = 5,
    lengths: tuple[int, ...] | list[int] = (),
    analysis: Analysis | None = None,
    root: str | os.PathLike | None = None,
) -> Path:
    """Write the figures, ``index.html`` and ``report.md`` into ``out_dir``; returns index.html.

    ``root``: the directory, ``out_dir`` or one above it, below which no link is followed
    (``skip_core.writing``); by default ``out_dir`` itself."""
    out = Path(out_dir)
    root = out if root is None else Path(root)
    relative = out.relative_to(root)
    result = analysis or analyze(logs, step=step, top=top, lengths=lengths)
    found = findings(result)
    sections = _sections(logs, result, draw(result, root, relative))
    title = f"Rollout profile: {logs.root}"
    writing.write_text(root, relative / "index.html", _html(title, found, sections))
    writing.write_text(root, relative / "report.md", _markdown(title, found, sections))
    return out / "index.html"


# --- sections ---------------------------------------------------------------------------------


def _sections(logs: Logs, a: Analysis, images: dict[str, str]) -> list[_Section]:
    return [
        s
        for s in (
            _s_read(logs),
            _s_completion(a, images),
            _s_rollout(a, images),
            _s_workers(a, images),
            _s_slowest(a, images),
            _s_shares(a, images),
            _s_turns(a, images),
            _s_tail(a, images),
            _s_trainer(a, images),
        )
        if s is not None
    ]


def _s_read(logs: Logs) -> _Section:
    text = [logs.summary() + "."]
    if logs.line_by_line:
        text.append(f"{len(logs.line_by_line)} files were read line by line (mixed types or garbage).")
    return _Section("Logs", text)


def _s_completion(a: Analysis, images) -> _Section:
    c = a.completion
    text = ["A request completes with its last event; times count from the step's first rollout-side event."]
    if c.headline_pct is not None:
        text.append(
            f"80% of requests completed within the first {c.headline_pct:.0f}% of the rollout (median over the "
            f"{len(c.backed)} of {c.table.num_rows} steps with at least {MIN_COUNT} requests in their last 20%)."
        )
    return _Section("Request completion", text, [_table("Per step", c.table)], images.get("cdf"))


def _s_rollout(a: Analysis, images) -> _Section:
    r = a.rollout
    text = [
        f"Median rollout time {units.duration(r.median)}; a step is a peak above {units.duration(r.threshold)} "
        f"(median + {PEAK_MADS:g} MAD, MAD at least {MAD_FLOOR:.0%} of the median, and more than "
        f"{PEAK_RATIO:g}× the median). Peaks are named from {MIN_STEPS} steps up: the median of fewer is no "
        f"baseline.",
        f"Peaks: {_ids(r.peaks)}." if r.peaks else "No peaks.",
    ]
    if r.left_out:
        text.append(f"Above the threshold but not named, {r.table.num_rows} steps being too few: {_ids(r.left_out)}.")
    return _Section("Rollout time per step", text, [_table("Per step", r.table)], images.get("rollout_time"))


def _s_workers(a: Analysis, images) -> _Section | None:
    w = a.workers
    if w is None:
        return None
    text = [f"Step {w.step} (rollout {units.duration(w.rollout_time)})."]
    if w.balanced is None:
        text.append("One rollout worker: nothing to compare it with, so no straggler and no barrier to wait at.")
    else:
        who = "no straggler" if w.straggler is None else f"the straggler is worker {w.straggler}"
        text.append(
            f"The straggler is the worker the others waited for (least barrier wait, then latest last completion); "
            f"it is named when the others' median wait exceeds its own by more than max({units.duration(LAG_MIN_S)}, "
            f"{LAG_ROLLOUT:.0%} of the rollout) = {units.duration(w.threshold)}. Here they waited "
            f"{units.duration(w.lag)} longer: {who}."
        )
    text.append(
        f"A gap is flagged when no request finished for longer than max({units.duration(GAP_MIN_S)}, "
        f"{GAP_FACTOR:g}× the worker's median gap between completions, {GAP_ROLLOUT:.0%} of the rollout)."
    )
    return _Section(f"Workers on step {w.step}", text, [_table("Per worker", w.table)], images.get("workers"))


def _s_slowest(a: Analysis, images) -> _Section | None:
    """The chosen step's slowest requests event by event, then the outliers of every step."""
    text, tables = [], []
    for r in a.slowest:
        line = (
            f"{r.request_id} on worker {r.workid}: {units.duration(r.duration)}, started "
            f"{units.duration(r.start)} into the rollout"
        )
        if r.dominant_event:
            line += f"; {r.dominant_event} took {units.duration(r.dominant_seconds)} of it"
        text.append(line + ".")
        rows = [
            [e["event"], _cell(e["turn"]), *(_cell(e[k], k) for k in ("start", "end", "duration")), _attrs(e["attrs"])]
            for e in r.events[:_MAX_EVENT_ROWS]
        ]
        more = len(r.events) - _MAX_EVENT_ROWS
        caption = f"{r.request_id} (times from the request's start)" + (f"; {more} more events" if more > 0 else "")
        tables.append(_Table(caption, ["event", "turn", "start", "end", "duration", "attributes"], rows))
    outliers = a.outliers.table
    text.append(
        f"Event outliers, all steps: spans whose time is above both median + {OUTLIER_MADS:g} MAD and "
        f"{OUTLIER_RATIO:g}× the median of their own event (per generated token for events whose spans all "
        f"carry tokens_out), by more than {units.duration(OUTLIER_MIN_S)} (events with at least "
        f"{OUTLIER_MIN_SPANS} spans; barrier waits are left out). `usual` is the time the event's median gives "
        f"the span (per token: the median time per token times its tokens); `ratio` is duration / usual. "
        f"Spans flagged: {outliers.num_rows or 'none'}."
    )
    if a.outliers.unjudged:
        few = ", ".join(f"{name} ({n} span{'s' * (n != 1)})" for name, n in a.outliers.unjudged.items())
        text.append(f"Not judged, too few spans for a median: {few}.")
    if outliers.num_rows:
        caption = "Event outliers, largest excess first" + (
            f" (first {_MAX_OUTLIER_ROWS} of {outliers.num_rows})" if outliers.num_rows > _MAX_OUTLIER_ROWS else ""
        )
        tables.append(_table(caption, outliers.slice(0, _MAX_OUTLIER_ROWS)))
    if not a.slowest and not outliers.num_rows:
        return None
    title = f"Slowest requests of step {a.slowest[0].step}" if a.slowest else "Slow events"
    return _Section(title, text, tables, images.get("slowest_requests"))


def _ids(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _attrs(attrs: dict) -> str:
    return ", ".join(f"{k}={_cell(v)}" for k, v in attrs.items())


def _s_shares(a: Analysis, images) -> _Section:
    s = a.shares
    text = [
        "For each rollout worker and step, T = busy time + barrier wait. Each instant of T is split evenly among "
        "the spans open at it (a worker runs many requests at once), so the events' shares add up to 100% with "
        f"{OTHER} (time no event covered); averaged over {s.pairs} worker-steps (0 where absent). Containers, "
        f"whose time is their children's, are left out: {', '.join(s.containers) or 'none'}."
    ]
    return _Section("Event shares", text, [_table("Avg % of total time", s.table)], images.get("event_share"))


def _s_turns(a: Analysis, images) -> _Section:
    t = a.turns
    by_turn = _pivot(t.by_turn, "step", "turn", "mean_generate", "turn ")
    tables = [
        _table("Mean request time by number of turns", t.by_count),
        _table("Mean generate time by step and turn index", by_turn, kind="time"),
        _table(
            "Share of requests by number of turns",
            _pivot(t.distribution, "step", "turns", "share", "", " turns"),
            kind="share",
        ),
    ]
    text = [
        "A request's turns are its `turns` attribute, else its number of generate events. `requests` and `calls` "
        f"say how many back each mean; the findings compare two turn counts only when each has at least "
        f"{MIN_COUNT} requests."
    ]
    return _Section("Turns", text, tables, images.get("turns"))


def _s_tail(a: Analysis, images) -> _Section:
    t = a.tail
    text = [
        f"Rollout wall time over the steps: {units.duration(t.total_rollout)} (the union of the steps' rollout "
        f"windows: overlapping steps count once); {t.requests} requests, {t.with_tokens} with token counts. "
        "`saved_s` is what that wall time loses when each step's last request ends earlier; `extra_time_s` is "
        "the wall time with any engine call running, times the extra share of requests."
    ]
    if t.note:
        text.append(f"Response length caps not estimated: {t.note}.")
    text.append("Assumptions: " + "; ".join(t.assumptions) + ".")
    tables = [
        _table("Capping max_response_length", t.caps),
        _table("Oversampling and dropping the slowest", t.oversample),
    ]
    return _Section("Tail advisor", text, tables, images.get("tail"))


def _s_trainer(a: Analysis, images) -> _Section | None:
    if a.trainer is None:
        return None
    table = a.trainer.table
    text = [
        "`total` is the step's wall time (its `trainer/step` span); each phase column is the phase's exclusive "
        "time, outside any phase it holds, so the columns and `other` (the step outside every phase) add up "
        "to `total`."
    ]
    if a.trainer.nested:
        held = "; ".join(f"{k} holds {', '.join(v)}" for k, v in a.trainer.nested.items())
        text.append(f"Nested phases: {held}.")
    return _Section("Trainer phases", text, [_table("Per step", table, kind="time")], images.get("trainer"))


def _pivot(table: pa.Table, row: str, col: str, value: str, prefix: str = "", suffix: str = "") -> pa.Table:
    data = table.to_pydict()
    rows, cols = sorted(set(data[row])), sorted(set(data[col]))
    cells = {(r, c): v for r, c, v in zip(data[row], data[col], data[value], strict=True)}
    out: dict[str, list] = {row: rows}
    for c in cols:
        out[f"{prefix}{c}{suffix}"] = [cells.get((r, c)) for r in rows]
    return pa.table(out) if rows else table


# --- rendering --------------------------------------------------------------------------------


def _table(caption: str, table: pa.Table, kind: str | None = None) -> _Table:
    """Cells as text. Columns say what they hold by name ("busy", "t80_s", "share"); a pivot or
    the trainer table, whose columns are named for steps or phases, passes the ``kind`` of
    every column but its first."""
    data = table.to_pydict()
    names = list(data)
    kinds = {n: "time" if n in _TIME_COLUMNS or n.endswith("_s") else n for n in names}
    if kind is not None:
        kinds.update(dict.fromkeys(names[1:], kind))
    rows = [[_cell(data[n][i], kinds[n]) for n in names] for i in range(table.num_rows)]
    return _Table(caption, names, rows)


def _cell(value: Any, kind: str = "") -> str:
    """``kind``: "time" for seconds, else the column's name, which says what else it holds."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if kind == "time" or kind in _TIME_COLUMNS:
            return units.duration(value)
        if kind.endswith("_pct"):
            return f"{value:.1f}%"
        if "share" in kind:
            return units.share(value)
        return f"{value:.2f}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def _html(title: str, found: list[Finding], sections: list[_Section]) -> str:
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        "<h2>Findings</h2>",
        '<ul class="findings">',
    ]
    parts += [f'<li class="{e(f.kind)}">{e(f.text)}</li>' for f in found] or ["<li>Nothing stood out.</li>"]
    parts.append("</ul>")
    for s in sections:
        parts.append(f"<h2>{e(s.title)}</h2>")
        parts += [f"<p>{e(t)}</p>" for t in s.text]
        if s.image:
            parts.append(f'<img src="{e(s.image)}" alt="{e(s.title)}">')
        for t in s.tables:
            parts.append(_html_table(t))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_table(t: _Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    return f"<table><caption>{e(t.caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _markdown(title: str, found: list[Finding], sections: list[_Section]) -> str:
    lines = [f"# {title}", "", "## Findings", ""]
    lines += [f"- {f.text}" for f in found] or ["- Nothing stood out."]
    for s in sections:
        lines += ["", f"## {s.title}", ""]
        for t in s.text:
            lines += [t, ""]
        if s.image:
            lines += [f"![{s.title}]({s.image})", ""]
        for t in s.tables:
            lines += [f"*{_md(t.caption)}*", "", _md_row(t.headers), _md_row(["---"] * len(t.headers))]
            lines += [_md_row(row) for row in t.rows]
            lines.append("")
    return "\n".join(lines) + "\n"


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(_md(c) for c in cells) + " |"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.4em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
ul.findings li { margin: .4em 0; }
img { max-width: 100%; display: block; margin: 1em 0; }
table { border-collapse: collapse; margin: 1em 0; font-size: .85em; }
caption { text-align: left; font-weight: 600; padding: .3em 0; }
th, td { border: 1px solid #ddd; padding: .2em .5em; text-align: right; }
td:first-child, th:first-child { text-align: left; }
"""
