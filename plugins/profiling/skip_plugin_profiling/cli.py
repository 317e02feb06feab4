"""``skip profile report|trace``: turn span logs into a report or a Perfetto trace.

pyarrow and matplotlib are imported inside the commands: ``skip`` builds its command tree on
every start, and listing commands should not pay for them.
"""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.group("profile")
def profile() -> None:
    """Analyse profiling logs ({dir}/step_{k}/worker_{r}.jsonl)."""


@profile.command("report")
@click.argument("log_dir", metavar="DIR", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Report directory (default DIR/report).")
@click.option("--step", type=int, help="Step to analyse in detail (default: the slowest rollout).")
@click.option("--top", type=int, default=5, show_default=True, help="Slowest requests to show.")
@click.option(
    "--max-response-length", "lengths", type=int, multiple=True, help="Response length cap to evaluate (repeatable)."
)
def report(log_dir: Path, out: Path | None, step: int | None, top: int, lengths: tuple[int, ...]) -> None:
    """Write figures, index.html and report.md explaining where rollout time went."""
    _analysis_stack()
    from skip_plugin_profiling.analysis import analyze, findings
    from skip_plugin_profiling.report import write_report

    started = time.perf_counter()
    logs = _read(log_dir)
    read_s = time.perf_counter() - started
    try:
        result = analyze(logs, step=step, top=top, lengths=lengths)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    found = findings(result)
    analysed_s = time.perf_counter() - started - read_s
    root, target = (out, out) if out else _default_out(log_dir, "report")
    index = write_report(logs, target, analysis=result, root=root)
    written_s = time.perf_counter() - started - read_s - analysed_s
    click.echo(f"Report: {index}")
    click.echo(f"Read {logs.summary()} in {read_s:.2f} s; analysed in {analysed_s:.2f} s; wrote in {written_s:.2f} s.")
    click.echo("Findings:" if found else "Findings: none (no rollout requests to analyse?)")
    for f in found:
        click.echo(f"  - {f.text}")


@profile.command("trace")
@click.argument("log_dir", metavar="DIR", type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), help="Trace file (default DIR/trace.json).")
@click.option("--step", "steps", type=int, multiple=True, help="Step to include (repeatable; default all).")
def trace(log_dir: Path, out: Path | None, steps: tuple[int, ...]) -> None:
    """Write a Chrome trace-event JSON file for ui.perfetto.dev or chrome://tracing."""
    _analysis_stack()
    from skip_plugin_profiling.trace import write_trace

    started = time.perf_counter()
    logs = _read(log_dir)
    available = logs.steps(None)
    missing = [s for s in steps if s not in available]
    if missing:
        raise click.ClickException(
            f"step {', '.join(map(str, missing))} not in the logs; steps available: {', '.join(map(str, available))}"
        )
    root, target = (out.parent, out) if out else _default_out(log_dir, "trace.json")
    path = write_trace(logs, target, steps=list(steps) or None, root=root)
    click.echo(f"Trace: {path} ({logs.summary()}; {time.perf_counter() - started:.2f} s)")
    click.echo("Open it at https://ui.perfetto.dev or chrome://tracing.")


def register(cli: click.Group) -> None:
    """Add ``profile`` to the ``skip`` command (called from the plugin's skip_register_commands)."""
    cli.add_command(profile)


def _analysis_stack() -> None:
    """Capture installs without what the commands read logs with (the ``analysis`` extra)."""
    try:
        import matplotlib  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"skip profile needs the analysis stack ({exc.name} is missing): pip install "
            "'skip-plugin-profiling[analysis]' (from a clone of skip: pip install './plugins/profiling[analysis]')"
        ) from None


def _read(log_dir: Path):
    from skip_plugin_profiling.logs import read_logs

    logs = read_logs(log_dir)
    if not len(logs):
        found = f"{len(logs.files)} .jsonl files with no readable events" if logs.files else "no .jsonl files"
        raise click.ClickException(f"no profiling logs in {log_dir}: {found} (expected DIR/step_K/worker_R.jsonl)")
    return logs


def _default_out(log_dir: Path, name: str) -> tuple[Path, Path]:
    """The root the command writes below, ``DIR`` (its user's choice, even if a link), and ``DIR/name``."""
    base = log_dir if log_dir.is_dir() else log_dir.parent
    return base, base / name
