"""What ``skip simulate`` prints and draws: the table, the published comparison, the
recommendation and the throughput plot."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from rich.table import Table
from skip_core import writing

from skip_plugin_simulate.config import Published
from skip_plugin_simulate.simulate import SPLIT_KEY, Result


def _rate(results: list[Result], schedule: str, point: list[str]) -> float | None:
    """``schedule``'s samples/s at ``point``; a schedule run at one split only (a colocated
    sync) stands for every split."""
    rows = [r for r in results if r.summary.schedule == schedule]
    exact = next((r for r in rows if r.point == point), None)
    found = exact or next((r for r in rows if _unsplit(r.point) == _unsplit(point)), None)
    return found.summary.samples_per_s if found else None


def _unsplit(point: list[str]) -> list[str]:
    return [o for o in point if not o.startswith(f"{SPLIT_KEY}=")]


def table(results: list[Result], title: str) -> Table:
    out = Table(title=title)
    columns = ("schedule", "settings", "engines / trainer devices", "mean step", "samples/s", "vs sync")
    for column in (*columns, "trainer idle", "rollout busy", "staleness mean / max", "partial"):
        out.add_column(column, justify="right", overflow="fold")  # a long sweep setting wraps, whole
    for r in results:
        s, base = r.summary, _rate(results, "sync", r.point)
        out.add_row(
            s.schedule,
            r.settings,
            f"{r.timeline.engines} / {r.timeline.trainer_devices}",
            f"{s.step_s:.2f} s",
            f"{s.samples_per_s:.2f}",
            f"{s.samples_per_s / base:.2f}x" if base else "",
            f"{s.trainer_idle:.0%}",
            f"{s.rollout_busy:.0%}",
            f"{s.staleness_mean:.2f} / {s.staleness_max:.0f}",
            f"{s.partial_ratio:.0%}",
        )
    return out


def staleness(results: list[Result]) -> str:
    """How many updates behind the trained samples were, per run that trained any stale one."""
    lines = []
    for r in results:
        shares = r.summary.staleness
        if max(shares, default=0) > 0:
            spread = ", ".join(f"{k}: {share:.0%}" for k, share in shares.items() if share >= 0.005)
            lines.append(f"  {r.label}: {spread}")
    return "\n".join(["staleness of the trained samples (updates behind: share):", *lines]) if lines else ""


def published(results: list[Result], figures: Published, point: list[str]) -> str:
    """The prediction at the sweep ``point`` beside what the preset's source reported."""

    base = _rate(results, figures.baseline, point)
    where = f" (at {' '.join(point)})" if point else ""
    lines = [f"published ({figures.source}), throughput against {figures.baseline}{where}:"]
    for schedule, figure in figures.speedup.items():
        mine = _rate(results, schedule, point)
        predicted = f"{mine / base:.2f}x" if mine and base else "not simulated"
        lines.append(f"  {schedule}: published {figure:.2f}x, predicted {predicted}")
    return "\n".join(lines)


def recommendation(results: list[Result]) -> str:
    best = max(results, key=lambda r: r.summary.samples_per_s)
    base = _rate(results, "sync", best.point)
    versus = f", {best.summary.samples_per_s / base:.2f}x sync" if base and best.summary.schedule != "sync" else ""
    where = f" with {' '.join(best.point)}" if best.point else ""
    return f"fastest: {best.summary.schedule}{where}: {best.summary.samples_per_s:.2f} samples/s{versus}"


def plot(results: list[Result], path: Path) -> Path | None:
    """Trained samples per second since the start against virtual time (one step's own rate
    swings with fully_async's sync windows); a failed write warns."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in results:
            rows, done = r.timeline.rows, 0.0
            rates = []
            for row in rows:
                done += row["samples"]
                rates.append(done / row["time_s"] if row["time_s"] else 0.0)
            ax.plot([row["time_s"] / 3600 for row in rows], rates, marker=".", label=r.label)
        ax.set_xlabel("virtual time (h)")
        ax.set_ylabel("trained samples / s since the start")
        ax.legend(fontsize="small")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", bbox_inches="tight")
        plt.close(fig)
        return writing.write_bytes(path.parent, path.name, buffer.getvalue())
    except Exception as exc:  # the plot is optional: the table is already printed
        warnings.warn(f"skip simulate: the plot could not be written to {path}: {exc!r}", RuntimeWarning, stacklevel=2)
        return None
