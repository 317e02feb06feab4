"""``skip diff``'s output: a ``Report`` as tables and one headline."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from skip_plugin_trainer.diff.compare import PER_TOKEN, Report, shown, step_ranges


def render(report: Report, console: Console) -> None:
    """The report: a table of the phases, what was not compared, the largest differences of the
    phase that differs first, and the headline."""
    if report.metrics_only:  # first: the tables below would read as a full comparison
        console.print(
            Text(
                "metrics only: no step has per-token training data on both sides; runs with "
                "trainer.save_train_data=true compare rollouts, log-probs and advantages token by token"
            )
        )
    table = Table(title=Text(f"skip diff  A: {report.a}  B: {report.b}"), title_justify="left")
    columns = ("phase", "steps", "compared", "beyond tolerance", "samples left out", "max |a-b|", "at", "mean |a-b|")
    for column in (*columns, "first step beyond"):
        table.add_column(column, overflow="fold")
    for p in report.phases:
        largest = p.largest if not p.exact else None
        cells = [p.name, step_ranges(p.steps), p.compared, p.beyond, p.left_out if p.name in PER_TOKEN else "-"]
        cells += [
            f"{largest.diff:.3g}" if largest else "-",
            f"step {largest.step}, {largest.place}" if largest and largest.diff else "-",
        ]
        cells += ["-" if p.exact else f"{p.mean:.3g}", "-" if p.first_step is None else p.first_step]
        table.add_row(*(Text(str(c), style="red" if p.first_step is not None else "") for c in cells))
    console.print(table)
    for label, steps in (("steps only in A", report.only_a), ("steps only in B", report.only_b)):
        if steps:
            console.print(Text(f"{label}: {step_ranges(steps)}"))
    for note, steps in report.notes.items():
        console.print(Text(note + (f" (steps {step_ranges(steps)})" if steps else "")))
    phase = report.first
    if phase is not None and phase.top:
        kind = "first" if phase.exact else "largest"
        top = Table(title=Text(f"{phase.name}: the {len(phase.top)} {kind} differences"), title_justify="left")
        for column in ("step", "where", "a", "b", "|a-b|"):
            top.add_column(column, overflow="fold")
        for d in phase.top:
            top.add_row(*(Text(c) for c in (str(d.step), d.place, shown(d.a), shown(d.b), f"{d.diff:.3g}")))
        console.print(top)
    console.print(Text(report.headline(), style="green" if report.agree else "bold red"))
