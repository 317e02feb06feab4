"""``skip diff``'s output: a ``Report`` as tables and one headline, and the command itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text
from skip_core.config import StepSet
from skip_core.errors import TRACEBACK_SWITCH, SkipError

from skip_plugin_trainer.diff.compare import PER_TOKEN, Report, compare, shown, step_ranges


def render(report: Report, console: Console) -> None:
    """The report: a table of the phases, what was not compared, the largest differences of the
    phase that differs first, and the headline."""
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


class _Incomparable(click.ClickException):
    """Input that cannot be compared: exit 2, as ``diff`` exits on trouble, never 1 (they differ)."""

    exit_code = 2


def _steps(ctx: click.Context, param: click.Parameter, value: str | None) -> StepSet | None:
    if value is None:
        return None
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(StepSet).validate_python([part.strip() for part in value.split(",")])
    except ValidationError as exc:
        raise click.BadParameter(exc.errors()[0]["msg"]) from None


def command(console: Console) -> click.Command:
    """``skip diff``, printing to ``console``."""

    @click.command("diff")
    @click.argument("a", type=click.Path(path_type=Path))
    @click.argument("b", type=click.Path(path_type=Path))
    @click.option("--atol", type=click.FloatRange(min=0), default=1e-5, show_default=True, help="Absolute tolerance.")
    @click.option(
        "--rtol", type=click.FloatRange(min=0), default=1e-4, show_default=True, help="Relative tolerance (of B)."
    )
    @click.option("--steps", callback=_steps, help="Only these steps: 3, 1..20, 5.. or a comma-separated list of them.")
    @click.option(
        "--ignore",
        multiple=True,
        metavar="PATTERN",
        help="Leave out the metrics matching PATTERN (fnmatch, e.g. 'rollout_corr/*'); may be repeated.",
    )
    @click.option("--top", type=click.IntRange(min=0), default=5, show_default=True, help="Differences listed.")
    def diff(
        a: Path, b: Path, atol: float, rtol: float, steps: StepSet | None, ignore: tuple[str, ...], top: int
    ) -> None:
        """Compare two runs (or two skip caches) A and B step by step and phase by phase.

        A and B are run directories (metrics.jsonl, train_data/ with trainer.save_train_data=true)
        or skip caches (a dump_dir, a run's directory in one, or a GBS... directory). Exit 0 when
        everything compared agrees within tolerance (|a-b| <= atol + rtol*|b|; tokens exactly), 1
        when something differs, 2 when A and B cannot be compared.
        """
        try:
            report = compare(a, b, atol, rtol, steps, top, ignore=ignore)
        except SkipError as exc:
            if os.environ.get(TRACEBACK_SWITCH) == "1":
                raise
            raise _Incomparable(" ".join(str(exc).split())) from None
        render(report, console)
        sys.exit(0 if report.agree else 1)

    return diff
