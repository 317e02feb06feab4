"""One PNG per analysis, drawn with matplotlib's object API on Agg canvases (no pyplot state,
no display). A figure that would mislead is not drawn: one rollout worker has nobody to be a
straggler against, so its figure shows only its completions and says so."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from skip_core import writing

from skip_plugin_profiling.results import Analysis
from skip_plugin_profiling.rollout import QUANTILES
from skip_plugin_profiling.units import duration
from skip_plugin_profiling.workers import OTHER

DPI = 100
FIGURES = ("cdf", "rollout_time", "workers", "slowest_requests", "event_share", "turns", "tail")
_OUTLINED = ("request", "turn", "rollout")  # containers: drawn as outlines so their children show


def draw(a: Analysis, root: Path, relative: Path) -> dict[str, str]:
    """Write every figure the analysis supports into ``root / relative`` (no link followed below
    ``root``: ``skip_core.writing``); returns name -> file name."""
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
    for name, drawer in drawers.items():
        fig = drawer(a)
        if fig is None:
            continue
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=DPI)
        writing.write_bytes(root, relative / f"{name}.png", image.getvalue())
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
    ax.axhline(r.median, color="black", lw=0.8, ls="--", label=f"median {duration(r.median)}")
    ax.axhline(r.threshold, color="tab:red", lw=0.8, ls=":", label=f"peak threshold {duration(r.threshold)}")
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
    """Busy and barrier wait side by side, and each worker's completions. With one worker
    there is nothing to set side by side: only its completions, titled as such."""
    w = a.workers
    if w is None:
        return None
    if w.table.num_rows < 2:
        fig, (cdf,) = _figure(7, 4.5)
        _worker_cdf(cdf, w)
        cdf.set_title(f"Step {w.step}: completions on the only rollout worker (nothing to compare)")
        return fig
    fig, (bars, cdf) = _figure(12, 4.5, 2)
    ids = w.table["workid"].to_pylist()
    busy, wait = w.table["busy"].to_numpy(), w.table["wait"].to_numpy()
    names = [str(i) for i in ids]
    bars.bar(names, busy, color=["tab:red" if i == w.straggler else "tab:blue" for i in ids])
    bars.bar(names, wait, bottom=busy, color="lightgray", hatch="//")
    legend = [Patch(color="tab:blue", label="busy")]
    if w.straggler is not None:
        legend.append(Patch(color="tab:red", label=f"busy, straggler (worker {w.straggler})"))
    legend.append(Patch(facecolor="lightgray", hatch="//", label="barrier wait"))
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
            text = f"worker {row['workid']}: {duration(row['gap'])} without a completion"
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
    events = [e for e in table["event"].to_pylist() if e != OTHER]
    shown = [*events[:12], OTHER]
    shares = dict(zip(table["event"].to_pylist(), table["mean_share"].to_pylist(), strict=True))
    colors = ["lightgray" if e == OTHER else "tab:blue" for e in shown]
    bars.barh(shown, [100 * shares[e] for e in shown], color=colors)
    bars.invert_yaxis()
    bars.set_xlabel("average % of a worker's step (busy + barrier wait); bars add up to 100%")
    bars.set_title("Event share, averaged over worker-steps")
    per_step = a.shares.per_step.to_pydict()
    for event in events[:top]:
        points = [
            (s, v) for s, e, v in zip(per_step["step"], per_step["event"], per_step["share"], strict=True) if e == event
        ]
        lines.plot([p[0] for p in points], [100 * p[1] for p in points], marker=".", label=event)
    lines.set_xlabel("step")
    lines.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines.set_ylabel("% of a worker's step")
    lines.set_title(f"Top {min(top, len(events))} events per step")
    if events:  # a log of request spans alone has no leaf event to draw
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
        bars = by_count.bar([str(k) for k in t.by_count["turns"].to_pylist()], t.by_count["mean_duration"].to_numpy())
        by_count.bar_label(bars, [f"n={n}" for n in t.by_count["requests"].to_pylist()], fontsize=8)
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
    """Each phase's exclusive time stacked: the bars reach the step's wall time, no higher."""
    if a.trainer is None:
        return None
    fig, (ax,) = _figure(10, 4)
    data = a.trainer.table.to_pydict()
    steps = [str(s) for s in data.pop("step")]
    total = data.pop("total")
    bottom = np.zeros(len(steps))
    palette = colormaps["tab20"]
    for i, (name, values) in enumerate(data.items()):
        ax.bar(steps, values, bottom=bottom, label=name, color="lightgray" if name == "other" else palette(i % 20))
        bottom += np.asarray(values, dtype=float)
    ax.plot(steps, total, ls="none", marker="_", markersize=14, color="black", label="step time")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Trainer phases per step (exclusive time; nested phases not counted twice)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _thin_ticks(ax, len(steps))
    return fig
