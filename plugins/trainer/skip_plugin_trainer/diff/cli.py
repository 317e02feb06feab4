"""``skip diff``, the command: registered on every start of ``skip``, so it imports the comparison
(numpy, torch through the training data's keys) only when it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from skip_core.config import StepSet
from skip_core.errors import TRACEBACK_SWITCH, SkipError


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
        from skip_plugin_trainer.diff.compare import compare
        from skip_plugin_trainer.diff.report import render

        try:
            report = compare(a, b, atol, rtol, steps, top, ignore=ignore)
        except SkipError as exc:
            if os.environ.get(TRACEBACK_SWITCH) == "1":
                raise
            raise _Incomparable(" ".join(str(exc).split())) from None
        render(report, console)
        sys.exit(0 if report.agree else 1)

    return diff
