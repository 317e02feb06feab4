"""``skip simulate``: the installed schedules against the simulated trainer, side by side."""

from __future__ import annotations

from pathlib import Path

import click
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from skip_core.config import ConfigError
from skip_core.plugins import registry

from skip_plugin_simulate.simulate import Summary, load, overrides_to_config, simulate, summarize

PRESETS = Path(__file__).parent / "presets"


def preset(name: str) -> tuple[str, dict]:
    """A preset by name (``presets/<name>.yaml``) or a YAML file's path."""
    path = Path(name)
    if not path.is_file():
        path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise click.BadParameter(f"no preset or file {name!r} (presets: {have})", param_hint="PRESET")
    return path.stem, OmegaConf.to_container(OmegaConf.load(path)) or {}


def table(summaries: list[Summary], title: str) -> Table:
    out = Table(title=title)
    columns = ("schedule", "steps", "mean step", "samples/s", "vs sync", "trainer idle", "rollout busy")
    for column in (*columns, "staleness mean / max", "partial"):
        out.add_column(column, justify="right")
    base = next((s.samples_per_s for s in summaries if s.schedule == "sync"), None)
    for s in summaries:
        out.add_row(
            s.schedule,
            str(s.steps),
            f"{s.step_s:.1f} s",
            f"{s.samples_per_s:.2f}",
            f"{s.samples_per_s / base:.2f}x" if base else "",
            f"{s.trainer_idle:.0%}",
            f"{s.rollout_busy:.0%}",
            f"{s.staleness_mean:.2f} / {s.staleness_max:.0f}",
            f"{s.partial_ratio:.0%}",
        )
    return out


def register(cli: click.Group) -> None:
    @cli.command("simulate")
    @click.argument("preset_name", metavar="PRESET", default="default")
    @click.argument("overrides", nargs=-1)
    @click.option(
        "--schedule", "-s", "schedules", multiple=True, help="a schedule to run (default: every installed one)"
    )
    def simulate_command(preset_name: str, overrides: tuple[str, ...], schedules: tuple[str, ...]) -> None:
        """Run the installed schedules against a simulated trainer and rollout (no model, no Ray).

        PRESET is a name from the plugin's presets or a YAML file; OVERRIDES are key=value
        (e.g. cluster.rollout_devices=4 async_training.staleness_threshold=0.5)."""
        name, base = preset(preset_name)
        try:
            sim, sections = load(overrides_to_config(base, list(overrides)))
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        console = Console()
        names = list(schedules) or sorted(registry().kinds.get("schedules", {}))
        summaries = []
        for schedule in names:
            try:
                timeline = simulate(sim, schedule, sections)
            except ConfigError as exc:
                raise click.UsageError(str(exc)) from None
            summaries.append(summarize(schedule, timeline))
        c = sim.cluster
        steps = sim.trainer.total_training_steps
        title = (
            f"skip simulate {name}: {steps} steps, {c.devices} devices ({c.rollout_devices} rollout when overlapped)"
        )
        console.print(table(summaries, title))
        best = max(summaries, key=lambda s: s.samples_per_s)
        console.print(f"fastest: {best.schedule} ({best.samples_per_s:.2f} samples/s)")
