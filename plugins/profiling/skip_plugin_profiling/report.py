"""A report a person reads once after a slow run: findings first, then each analysis with its
table and figure, as one self-contained ``index.html`` (and the same in ``report.md``).

Figures are drawn with matplotlib's object API on Agg canvases (no pyplot state, no display),
one PNG per analysis. Every string that came from the logs (event names, request ids, tool
names) is escaped before it reaches HTML.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from skip_plugin_profiling.analysis import QUANTILES, Analysis, Finding, analyze, findings
from skip_plugin_profiling.logs import Logs

DPI = 100
FIGURES = ("cdf", "rollout_time", "workers", "slowest_requests", "event_share", "turns", "tail")
_MAX_EVENT_ROWS = 40
_OUTLINED = ("request", "turn", "rollout")  # containers: drawn as outlines so their children show


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
) -> Path:
    """Write the figures, ``index.html`` and ``report.md`` into ``out_dir``; returns index.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = analysis or analyze(logs, step=step, top=top, lengths=lengths)
    found = findings(result)
    images = _figures(result, out)
    sections = _sections(logs, result, images)
    title = f"Rollout profile: {logs.root}"
    (out / "index.html").write_text(_html(title, found, sections), encoding="utf-8")
    (out / "report.md").write_text(_markdown(title, found, sections), encoding="utf-8")
    return out / "index.html"


# --- figures ----------------------------------------------------------------------------------


def _figures(a: Analysis, out: Path) -> dict[str, str]:
    drawers = {
        "cdf": _fig_cdf,
        "rollout_time": _fig_rollout,
        "workers": _fig_workers,
        "slowest_requests": _fig_slowest,
        "event_share": _fig_shares,
        "turns": _fig_turns,
        "tail": _fig_tail,
        "trainer": _fig_trainer,
    }
    images = {}
    for name, draw in drawers.items():
        fig = draw(a)
        if fig is None:
            continue
        fig.savefig(out / f"{name}.png", dpi=DPI)
        images[name] = f"{name}.png"
    return images


def _figure(width: float, height: float, panels: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0].tolist()
    return fig, axes


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_axis_off()


def _step_colors(steps: list[int]) -> dict[int, Any]:
    cmap = colormaps["viridis"]
    n = max(len(steps) - 1, 1)
    return {s: cmap(i / n) for i, s in enumerate(steps)}


def _labelled_steps(a: Analysis, steps: list[int], most: int = 6) -> set[int]:
    """Many steps make an unreadable legend: label the first, last, peaks and the chosen one."""
    if len(steps) <= most:
        return set(steps)
    return {steps[0], steps[-1], *a.rollout.peaks[:3], *([a.step] if a.step is not None else [])}


def _fig_cdf(a: Analysis) -> Figure:
    fig, (abs_ax, rel_ax) = _figure(12, 4.5, 2)
    curves = a.completion.curves
    if not curves:
        _empty(abs_ax, "no requests with a request_id")
        _empty(rel_ax, "")
        return fig
    steps = sorted(curves)
    colors, labelled = _step_colors(steps), _labelled_steps(a, steps)
    times = dict(
        zip(a.completion.table["step"].to_pylist(), a.completion.table["rollout_time"].to_pylist(), strict=True)
    )
    for step in steps:
        done = curves[step]
        frac = np.arange(1, len(done) + 1) / len(done)
        peak = step in a.rollout.peaks
        style = {"color": "tab:red" if peak else colors[step], "lw": 2 if peak else 1, "alpha": 0.9}
        label = f"step {step}" + (" (peak)" if peak else "") if step in labelled else None
        abs_ax.step(done, frac, where="post", label=label, **style)
        rollout = times[step] or 1.0
        rel_ax.step(100 * done / rollout, frac, where="post", **style)
    for ax in (abs_ax, rel_ax):
        for q in QUANTILES:
            ax.axhline(q, color="gray", lw=0.6, ls=":")
            ax.text(1.0, q, f" {q:.0%}", transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="gray")
        ax.set_ylabel("share of requests completed")
        ax.set_ylim(0, 1.02)
    if a.completion.headline_pct is not None:
        rel_ax.axvline(a.completion.headline_pct, color="black", lw=0.8, ls="--")
        rel_ax.text(a.completion.headline_pct, 0.05, f" 80% by {a.completion.headline_pct:.0f}% (median)", fontsize=8)
    abs_ax.set_xlabel("seconds since the step's rollout started")
    rel_ax.set_xlabel("% of the step's rollout time")
    abs_ax.set_title("Request completion per step")
    rel_ax.set_title("Same, as a share of each step's rollout")
    if len(steps) > 6:
        fig.colorbar(_scalar_mappable(steps), ax=rel_ax, label="step")
    if abs_ax.get_legend_handles_labels()[0]:
        abs_ax.legend(fontsize=8, loc="lower right")
    return fig


def _scalar_mappable(steps: list[int]):
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    return ScalarMappable(norm=Normalize(min(steps), max(steps)), cmap=colormaps["viridis"])


def _fig_rollout(a: Analysis) -> Figure:
    fig, (ax,) = _figure(10, 4)
    r = a.rollout
    if not r.table.num_rows:
        _empty(ax, "no rollout events")
        return fig
    steps, times = r.table["step"].to_pylist(), r.table["rollout_time"].to_pylist()
    peaks = set(r.peaks)
    colors = ["tab:red" if s in peaks else "tab:blue" for s in steps]
    ax.bar([str(s) for s in steps], times, color=colors)
    ax.axhline(r.median, color="black", lw=0.8, ls="--", label=f"median {r.median:.1f} s")
    ax.axhline(r.threshold, color="tab:red", lw=0.8, ls=":", label=f"peak threshold {r.threshold:.1f} s")
    for i, (s, t) in enumerate(zip(steps, times, strict=True)):
        if s in peaks:
            ax.annotate(f"{t / r.median:.1f}×", (i, t), ha="center", va="bottom", color="tab:red", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("rollout time (s)")
    ax.set_title("Rollout time per step (peaks in red)")
    ax.legend(fontsize=8)
    _thin_ticks(ax, len(steps))
    return fig


def _thin_ticks(ax, n: int, most: int = 30) -> None:
    if n > most:
        every = math.ceil(n / most)
        for i, label in enumerate(ax.get_xticklabels()):
            label.set_visible(i % every == 0)


def _fig_workers(a: Analysis) -> Figure | None:
    w = a.workers
    if w is None:
        return None
    fig, (bars, cdf) = _figure(12, 4.5, 2)
    ids = w.table["workid"].to_pylist()
    busy, wait = w.table["busy"].to_numpy(), w.table["wait"].to_numpy()
    names = [str(i) for i in ids]
    colors = ["tab:red" if i == w.straggler else "tab:blue" for i in ids]
    bars.bar(names, busy, color=colors)
    bars.bar(names, wait, bottom=busy, color="lightgray", hatch="//")
    legend = [
        Patch(color="tab:blue", label="busy"),
        Patch(color="tab:red", label=f"busy, straggler (worker {w.straggler})"),
        Patch(facecolor="lightgray", hatch="//", label="barrier wait"),
    ]
    bars.set_xlabel("rollout worker")
    bars.set_ylabel("seconds")
    bars.set_title(f"Step {w.step}: busy + barrier wait per worker")
    bars.legend(handles=legend, fontsize=8)
    _worker_cdf(cdf, w)
    return fig


def _worker_cdf(ax, w) -> None:
    others = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 3]  # 3 is red: the straggler's
    for n, (worker, done) in enumerate(w.completions.items()):
        if not len(done):
            continue
        strag = worker == w.straggler
        frac = np.arange(1, len(done) + 1) / len(done)
        color = "tab:red" if strag else others[n % len(others)]
        label = f"worker {worker}" + (" (straggler)" if strag else "")
        ax.step(done, frac, where="post", lw=2 if strag else 1, color=color, label=label)
    for row in w.table.to_pylist():
        if row["gap_flagged"]:
            done = w.completions[row["workid"]]
            y = (np.searchsorted(done, row["gap_from"], side="right")) / len(done)
            ax.annotate(
                "", (row["gap_to"], y), (row["gap_from"], y), arrowprops={"arrowstyle": "<->", "color": "black"}
            )
            text = f"worker {row['workid']}: {row['gap']:.0f} s without a completion"
            ax.text((row["gap_from"] + row["gap_to"]) / 2, y + 0.02, text, ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("seconds since the step's rollout started")
    ax.set_ylabel("share of the worker's requests completed")
    ax.set_title(f"Step {w.step}: completion per worker")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2 if len(w.completions) > 8 else 1, loc="lower right")
    else:
        _empty(ax, "no requests with a request_id")


def _fig_slowest(a: Analysis) -> Figure | None:
    if not a.slowest:
        return None
    rows = []  # (label, events)
    separators = []
    for r in a.slowest:
        if rows:
            separators.append(len(rows) - 0.5)
        by_turn: dict[Any, list] = {}
        for e in r.events:
            by_turn.setdefault(e["turn"] if e["turn"] is not None else 0, []).append(e)
        for turn in sorted(by_turn, key=lambda t: (t is None, t)):
            label = f"{_short(r.request_id)} · w{r.workid}" + (f" · turn {turn}" if turn else "")
            rows.append((label, by_turn[turn]))
    fig, (ax,) = _figure(12, max(3.0, 0.3 * len(rows) + 1.5))
    names = sorted({e["event"] for _, events in rows for e in events})
    palette = colormaps["tab20"]
    colors = {n: palette(i % 20) for i, n in enumerate(names)}
    for y, (_, events) in enumerate(rows):
        for e in events:
            container = e["event"] in _OUTLINED
            ax.barh(
                y, max(e["end"] - e["start"], 1e-3), left=e["start"], height=0.8 if not container else 0.95,
                color="none" if container else colors[e["event"]], edgecolor=colors[e["event"]], lw=0.8,
            )  # fmt: skip
    for y in separators:
        ax.axhline(y, color="gray", lw=0.5)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the request started")
    ax.set_title(f"Slowest requests of step {a.slowest[0].step}: events by turn")
    handles = [Patch(facecolor="none" if n in _OUTLINED else colors[n], edgecolor=colors[n], label=n) for n in names]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _short(text: str, most: int = 14) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def _fig_shares(a: Analysis, top: int = 6) -> Figure:
    fig, (bars, lines) = _figure(12, 4.5, 2)
    table = a.shares.table
    if not table.num_rows:
        _empty(bars, "no events to share")
        _empty(lines, "")
        return fig
    shown = table.slice(0, 12)
    bars.barh(shown["event"].to_pylist(), 100 * shown["mean_share"].to_numpy(), color="tab:blue")
    bars.invert_yaxis()
    bars.set_xlabel("average % of a worker's step (busy + barrier wait)")
    bars.set_title("Event share, averaged over worker-steps")
    per_step = a.shares.per_step.to_pydict()
    for event in table["event"].to_pylist()[:top]:
        points = [
            (s, v) for s, e, v in zip(per_step["step"], per_step["event"], per_step["share"], strict=True) if e == event
        ]
        lines.plot([p[0] for p in points], [100 * p[1] for p in points], marker=".", label=event)
    lines.set_xlabel("step")
    lines.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines.set_ylabel("% of a worker's step")
    lines.set_title(f"Top {min(top, table.num_rows)} events per step")
    lines.legend(fontsize=8)
    return fig


def _fig_turns(a: Analysis) -> Figure:
    fig, (per_turn, by_count, dist) = _figure(15, 4.5, 3)
    t = a.turns
    if not t.by_turn.num_rows:
        _empty(per_turn, "no generate events")
    else:
        data = t.by_turn.to_pydict()
        for turn in sorted(set(data["turn"])):
            pts = [
                (s, m) for s, k, m in zip(data["step"], data["turn"], data["mean_generate"], strict=True) if k == turn
            ]
            per_turn.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"turn {turn}")
        per_turn.set_xlabel("step")
        per_turn.xaxis.set_major_locator(MaxNLocator(integer=True))
        per_turn.set_ylabel("mean generate time (s)")
        per_turn.set_title("Engine time per turn index")
        per_turn.legend(fontsize=7)
    if not t.by_count.num_rows:
        _empty(by_count, "no requests")
    else:
        by_count.bar([str(k) for k in t.by_count["turns"].to_pylist()], t.by_count["mean_duration"].to_numpy())
        by_count.set_xlabel("turns in the request")
        by_count.set_ylabel("mean request time (s)")
        by_count.set_title("Request time by number of turns")
    _turn_distribution(dist, t.distribution)
    return fig


def _turn_distribution(ax, table: pa.Table) -> None:
    if not table.num_rows:
        _empty(ax, "no requests")
        return
    data = table.to_pydict()
    steps = sorted(set(data["step"]))
    counts = sorted(set(data["turns"]))
    share = {(s, k): v for s, k, v in zip(data["step"], data["turns"], data["share"], strict=True)}
    bottom = np.zeros(len(steps))
    cmap = colormaps["plasma"]
    for i, k in enumerate(counts):
        values = np.array([100 * share.get((s, k), 0.0) for s in steps])
        ax.bar([str(s) for s in steps], values, bottom=bottom, label=f"{k} turns", color=cmap(i / max(len(counts), 2)))
        bottom += values
    ax.set_xlabel("step")
    ax.set_ylabel("% of requests")
    ax.set_title("Turns per request, per step")
    ax.legend(fontsize=7)
    _thin_ticks(ax, len(steps))


def _fig_tail(a: Analysis) -> Figure:
    fig, (caps, drops) = _figure(12, 4.5, 2)
    tail = a.tail
    if not tail.caps.num_rows:
        _empty(caps, tail.note or "no token counts")
    else:
        data = tail.caps.to_pydict()
        caps.plot(data["length"], data["saved_pct"], marker="o")
        for x, y, tr in zip(data["length"], data["saved_pct"], data["truncated_share"], strict=True):
            caps.annotate(f"{tr:.1%} cut", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        caps.set_xlabel("max_response_length (tokens)")
        caps.set_ylabel("estimated rollout time saved (%)")
        caps.set_title("Capping the response length")
    data = tail.oversample.to_pydict()
    if data["drop"]:
        drops.bar([f"{d:.0%}" for d in data["drop"]], data["saved_pct"], color="tab:green")
        for i, (y, extra) in enumerate(zip(data["saved_pct"], data["extra_requests_pct"], strict=True)):
            drops.annotate(f"+{extra:.0f}% requests", (i, y), ha="center", va="bottom", fontsize=8)
    drops.set_xlabel("oversample and drop the slowest")
    drops.set_ylabel("estimated rollout time saved (%)")
    drops.set_title("Oversampling")
    return fig


def _fig_trainer(a: Analysis) -> Figure | None:
    if a.trainer is None:
        return None
    fig, (ax,) = _figure(10, 4)
    data = a.trainer.to_pydict()
    steps = [str(s) for s in data.pop("step")]
    bottom = np.zeros(len(steps))
    for name, values in data.items():
        ax.bar(steps, values, bottom=bottom, label=name)
        bottom += np.asarray(values, dtype=float)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Trainer phases per step")
    ax.legend(fontsize=7)
    _thin_ticks(ax, len(steps))
    return fig


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
        text.append(f"80% of requests completed within the first {c.headline_pct:.0f}% of the rollout (median).")
    return _Section("Request completion", text, [_table("Per step", c.table)], images.get("cdf"))


def _s_rollout(a: Analysis, images) -> _Section:
    r = a.rollout
    text = [
        f"Median rollout time {r.median:.1f} s; a step is a peak above {r.threshold:.1f} s "
        f"(median + 3 MAD, MAD at least 5% of the median, and more than 1.25× the median)."
    ]
    text.append(f"Peaks: {', '.join(map(str, r.peaks))}." if r.peaks else "No peaks.")
    return _Section("Rollout time per step", text, [_table("Per step", r.table)], images.get("rollout_time"))


def _s_workers(a: Analysis, images) -> _Section | None:
    w = a.workers
    if w is None:
        return None
    text = [
        f"Step {w.step} (rollout {w.rollout_time:.1f} s). Straggler: worker {w.straggler}, "
        f"busy {w.straggler_busy:.1f} s; the others waited {w.mean_wait_others:.1f} s on average, "
        f"{w.max_wait_others:.1f} s at most.",
        "A gap is flagged when no request finished for longer than max(10 s, 5× the worker's median gap between "
        "completions, 20% of the rollout).",
    ]
    return _Section(f"Workers on step {w.step}", text, [_table("Per worker", w.table)], images.get("workers"))


def _s_slowest(a: Analysis, images) -> _Section | None:
    if not a.slowest:
        return None
    text, tables = [], []
    for r in a.slowest:
        line = f"{r.request_id} on worker {r.workid}: {r.duration:.1f} s, started {r.start:.1f} s into the rollout"
        if r.dominant_event:
            line += f"; {r.dominant_event} took {r.dominant_seconds:.1f} s of it"
        text.append(line + ".")
        rows = [
            [e["event"], _cell(e["turn"]), _cell(e["start"]), _cell(e["end"]), _cell(e["duration"]), _attrs(e["attrs"])]
            for e in r.events[:_MAX_EVENT_ROWS]
        ]
        more = len(r.events) - _MAX_EVENT_ROWS
        caption = f"{r.request_id} (times from the request's start)" + (f"; {more} more events" if more > 0 else "")
        tables.append(_Table(caption, ["event", "turn", "start", "end", "duration", "attributes"], rows))
    return _Section(f"Slowest requests of step {a.slowest[0].step}", text, tables, images.get("slowest_requests"))


def _attrs(attrs: dict) -> str:
    return ", ".join(f"{k}={_cell(v)}" for k, v in attrs.items())


def _s_shares(a: Analysis, images) -> _Section:
    s = a.shares
    text = [
        "For each rollout worker and step, T = busy time + barrier wait; an event's time is the union of its "
        "spans on that worker (concurrent requests count once); its share is that time / T, averaged over "
        f"{s.pairs} worker-steps (0 where absent). Containers left out: {', '.join(s.containers) or 'none'}."
    ]
    return _Section("Event shares", text, [_table("Avg % of total time", s.table)], images.get("event_share"))


def _s_turns(a: Analysis, images) -> _Section:
    t = a.turns
    tables = [
        _table("Mean request time by number of turns", t.by_count),
        _table(
            "Mean generate time by step and turn index", _pivot(t.by_turn, "step", "turn", "mean_generate", "turn ")
        ),
        _table("Share of requests by number of turns", _pivot(t.distribution, "step", "turns", "share", "", " turns")),
    ]
    text = ["A request's turns are its `turns` attribute, else its number of generate events."]
    return _Section("Turns", text, tables, images.get("turns"))


def _s_tail(a: Analysis, images) -> _Section:
    t = a.tail
    text = [f"Total rollout time over the steps: {t.total_rollout:.1f} s."]
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
    return _Section("Trainer phases (seconds)", [], [_table("Per step", a.trainer)], images.get("trainer"))


def _pivot(table: pa.Table, row: str, col: str, value: str, prefix: str = "", suffix: str = "") -> pa.Table:
    data = table.to_pydict()
    rows, cols = sorted(set(data[row])), sorted(set(data[col]))
    cells = {(r, c): v for r, c, v in zip(data[row], data[col], data[value], strict=True)}
    out: dict[str, list] = {row: rows}
    for c in cols:
        out[f"{prefix}{c}{suffix}"] = [cells.get((r, c)) for r in rows]
    return pa.table(out) if rows else table


# --- rendering --------------------------------------------------------------------------------


def _table(caption: str, table: pa.Table) -> _Table:
    data = table.to_pydict()
    names = list(data)
    rows = [[_cell(data[n][i], n) for n in names] for i in range(table.num_rows)]
    return _Table(caption, names, rows)


def _cell(value: Any, name: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        if name.endswith("_pct"):
            return f"{value:.1f}%"
        if "share" in name:
            return f"{value:.1%}"
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
