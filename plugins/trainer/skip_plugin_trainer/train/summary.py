"""The end of a run: a table of its steps' totals and a plot of its scores and each step's phases."""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import rich.console
import rich.table
from skip_core import writing
from skip_core.schedule import GEN, STEP, TRAIN_PHASES, WEIGHT_SYNC

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: The order phases stack in when the caller names none: the contract's, as the sync schedule runs them.
CONTRACT_PHASES = (GEN, *TRAIN_PHASES, WEIGHT_SYNC)

#: The trainer's ``testing`` times the validation rollouts and their scoring; "other" would hide the largest
#: phase of a due step.
_PHASE_LABELS = {"testing": "validation"}

#: Background phases' markers: each a black dotted line over the bars.
_BACKGROUND_MARKERS = ("D", "^", "v", "s")

_TRAIN_SCORE = "critic/score/mean"
_STEP_S, _GEN_S = f"timing_s/{STEP}", f"timing_s/{GEN}"

_VAL_MEAN = re.compile(r"^val(-core)?/.*(score|reward)/mean(@\d+)?$")


def _fmt(value: Any, spec: str = "{:.4g}") -> str:
    return "-" if value is None else spec.format(value)


def _totals(history: Sequence[Mapping[str, Any]]) -> str:
    """One line answering: how long did it take, where did the time go, did the score move."""
    steps = [r[_STEP_S] for r in history if _STEP_S in r]
    gens = [r[_GEN_S] for r in history if _STEP_S in r and _GEN_S in r]
    scores = [r["critic/score/mean"] for r in history if "critic/score/mean" in r]
    total = sum(steps) if steps else None
    return " · ".join(
        [
            f"total {_fmt(total, '{:.1f}')}s",
            f"mean step {_fmt(total / len(steps) if steps else None, '{:.2f}')}s",
            f"gen {_fmt(sum(gens) / total * 100 if gens and total else None, '{:.0f}')}% of step time",
            f"score {_fmt(scores[0] if scores else None)} → {_fmt(scores[-1] if scores else None)}",
        ]
    )


def summary_table(history: Sequence[Mapping[str, Any]], title: str = "skip run") -> rich.table.Table:
    """End-of-run overview, one row per step, with run totals in the caption."""
    columns = [
        ("score", "critic/score/mean", "{:.4g}"),
        ("resp len", "response_length/mean", "{:.4g}"),
        ("entropy", "actor/entropy", "{:.4g}"),
        ("pg loss", "actor/pg_loss", "{:.4g}"),
        ("grad norm", "actor/grad_norm", "{:.4g}"),
        ("gen s", _GEN_S, "{:.2f}"),
        ("step s", _STEP_S, "{:.2f}"),
    ]
    table = rich.table.Table(title=title, caption=_totals(history))
    table.add_column("step", justify="right")
    for label, _, _ in columns:
        table.add_column(label, justify="right")
    for record in history:
        table.add_row(str(record.get("step", "-")), *(_fmt(record.get(key), spec) for _, key, spec in columns))
    return table


def plot(
    history: Sequence[Mapping[str, Any]],
    path: Path,
    phases: Sequence[str] = CONTRACT_PHASES,
    background: Sequence[str] = (),
) -> Path:
    """``plot_figure`` as a PNG at ``path``, written atomically so a crash never leaves half an image."""
    buffer = io.BytesIO()
    plot_figure(history, phases, background).savefig(buffer, format="png")
    path = Path(path)
    return writing.write_bytes(path.parent, path.name, buffer.getvalue())


def plot_figure(
    history: Sequence[Mapping[str, Any]], phases: Sequence[str] = CONTRACT_PHASES, background: Sequence[str] = ()
) -> Figure:
    """Score and stacked phase times per step, so a cached (collapsed) gen phase stands out; returned rather than
    saved so its lines and bars can be read back. Legends sit right of the axes, where they cannot cover data.

    ``phases``: the order the run's phases stack in (the trainer's: its schedule's, then its own), which also gives
    each its colour, so a phase keeps both from run to run; ``background``: phases that ran beside the step, not in
    it (one_step_off's ``generate_async``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 6), layout="constrained")
    FigureCanvasAgg(fig)
    score_ax, time_ax = fig.subplots(2, 1, sharex=True)
    for keys, steps, values in _score_series(history):
        style = {"marker": "o"} if keys[0] == _TRAIN_SCORE else {"marker": "s", "linestyle": "--"}
        score_ax.plot(steps, values, label=" = ".join("train" if k == _TRAIN_SCORE else k for k in keys), **style)
    score_ax.set_ylabel("score mean")
    _phase_bars(time_ax, history, phases, background)
    time_ax.set_xlabel("step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    time_ax.set_ylabel("step time (s)")
    for ax in (score_ax, time_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def _score_series(history: Sequence[Mapping[str, Any]]) -> list[tuple[list[str], list[int], list[float]]]:
    """Train, then validation score means (overall before per source) as (keys, steps, values). A series equal to
    one already kept joins its keys instead of drawing a second line on top of it: the only data source's mean is
    the overall mean (``val/score/mean = val/arithmetic/score/mean``); train is val in a run scoring 0 throughout."""
    val_keys = sorted({k for r in history for k in r if _VAL_MEAN.match(k)}, key=lambda k: (k.count("/"), k))
    series: list[tuple[list[str], list[int], list[float]]] = []
    for key in (_TRAIN_SCORE, *val_keys):
        steps, values = [r["step"] for r in history if key in r], [r[key] for r in history if key in r]
        if not steps:
            continue
        same = next((s for s in series if s[1] == steps and np.allclose(s[2], values, equal_nan=True)), None)
        if same is None:
            series.append(([key], steps, values))
        else:
            same[0].append(key)
    return series


def _phase_bars(
    ax: Axes, history: Sequence[Mapping[str, Any]], order: Sequence[str], background: Sequence[str]
) -> None:
    """Every phase the driver timed, stacked in ``order``, then "other" up to the step's wall time (the prompts'
    loading, metrics: the step outside every phase). A phase missing from ``order`` gets a bar of its own after them
    rather than vanishing into "other"."""
    from matplotlib import colormaps

    timed = [r for r in history if any(k.startswith("timing_s/") for k in r)]
    names = {k.removeprefix("timing_s/") for r in timed for k in r if k.startswith("timing_s/")}
    phases = [p for p in order if p in names] + sorted(names - {*order, STEP, *background})
    # tab20's strong hues, then its light ones, without its grays: gray is "other".
    tab20 = colormaps["tab20"].colors
    palette = [tab20[i] for i in (*range(0, 20, 2), *range(1, 20, 2)) if i not in (14, 15)]
    steps = [r["step"] for r in timed]
    bottom = np.zeros(len(timed))
    for phase in phases:
        heights = np.array([r.get(f"timing_s/{phase}", 0.0) for r in timed])
        color = palette[(*order, *phases).index(phase) % len(palette)]
        ax.bar(steps, heights, bottom=bottom, label=_PHASE_LABELS.get(phase, phase), color=color)
        bottom += heights
    other = np.array([max(r.get(_STEP_S, 0.0) - b, 0.0) for r, b in zip(timed, bottom, strict=True)])
    if other.any():
        ax.bar(steps, other, bottom=bottom, label="other", color="lightgray")
    # A background phase ran while the step's phases ran (one_step_off's generation on the rollout pool: its wait
    # shows as this step's gen): stacked, it would add seconds the step did not take, so it is a line over the bars.
    for phase, marker in zip(background, itertools.cycle(_BACKGROUND_MARKERS)):
        rows = [r for r in timed if f"timing_s/{phase}" in r]
        if rows:
            seconds = [r[f"timing_s/{phase}"] for r in rows]
            label = f"{phase} (background, not stacked)"
            ax.plot([r["step"] for r in rows], seconds, color="black", marker=marker, linestyle=":", label=label)
