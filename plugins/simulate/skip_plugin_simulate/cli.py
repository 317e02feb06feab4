"""``skip simulate``: the installed schedules against the simulated trainer, side by side."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import click
from omegaconf import OmegaConf
from rich.console import Console
from skip_core.config import ConfigError
from skip_core.plugins import registry

if TYPE_CHECKING:
    from skip_plugin_simulate.measured import Measured

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


def sweep_points(sweeps: tuple[str, ...]) -> list[list[str]]:
    """``key=a,b`` options as every combination of ``key=value`` overrides."""
    axes = []
    for sweep in sweeps:
        key, sep, values = sweep.partition("=")
        if not sep or not key or not values:
            raise click.BadParameter(f"{sweep!r}: expected key=value1,value2,...", param_hint="--sweep")
        axes.append([f"{key}={value}" for value in values.split(",")])
    return [list(point) for point in itertools.product(*axes)]


def preset_point(base: dict, points: list[list[str]]) -> list[str]:
    """The sweep point that keeps the preset's own values (what its published figure is about),
    else the first."""
    config = OmegaConf.create(base)
    for point in points:
        wanted = OmegaConf.from_dotlist(point)
        if all(
            OmegaConf.select(config, o.partition("=")[0]) == OmegaConf.select(wanted, o.partition("=")[0])
            for o in point
        ):
            return point
    return points[0]


def describe(m: Measured, directory: Path) -> str:
    samples = sum(len(group) for group in m.groups)
    return (
        f"measured in {directory}: {len(m.groups)} prompts, {samples} samples, {m.steps} steps; engine fit to"
        f" {m.engine_fit}: decode step {1000 * m.decode_s:.2f} ms + {1000 * m.decode_s_per_row:.3f} ms per row"
        f" (at most {m.max_batch} rows seen), prefill {1e6 * m.prefill_s_per_token:.1f} us per token; training"
        f" {m.fixed_s:.3f} s + {1e6 * m.s_per_token:.1f} us per token; weight sync {m.sync_s:.3f} s"
    )


def register(cli: click.Group) -> None:
    @cli.command("simulate")
    @click.argument("preset_name", metavar="PRESET", default="default")
    @click.argument("overrides", nargs=-1)
    @click.option("--schedule", "-s", "schedules", multiple=True, help="a schedule to run (default: every one)")
    @click.option("--sweep", "sweeps", multiple=True, help="key=v1,v2,...: try each value (combinations of several)")
    @click.option(
        "--split",
        "shares",
        default="0.25,0.5,0.75",
        show_default=True,
        help="shares of the devices for rollout that the recommendation also tries (none: only the scenario's)",
    )
    @click.option("--from-profile", "profile", type=click.Path(exists=True, file_okay=False, path_type=Path))
    @click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="throughput plot")
    @click.option("--check", is_flag=True, help="Validate the scenario and every sweep point, list the runs; run none.")
    def simulate_command(
        preset_name: str,
        overrides: tuple[str, ...],
        schedules: tuple[str, ...],
        sweeps: tuple[str, ...],
        shares: str,
        profile: Path | None,
        plot_path: Path | None,
        check: bool,
    ) -> None:
        """Run the installed schedules against a simulated trainer and rollout (no model, no Ray).

        PRESET is a name from the plugin's presets or a YAML file; OVERRIDES are key=value
        (e.g. cluster.rollout_devices=4 async_training.staleness_threshold=0.5). With
        --from-profile, requests, engines, training and weight sync are fit to a profile of a
        real run (the directory `skip profile report` reads). The plot goes to
        runs/simulate/PRESET.png unless --plot names another file. Unless --sweep sets
        cluster.rollout_devices, every overlapped schedule also runs at the splits --split
        names."""
        # `skip` builds its command tree on every start: the simulator (torch, pyarrow) loads here.
        from skip_core.progress import progress

        from skip_plugin_simulate.measured import read_profile
        from skip_plugin_simulate.report import plot, published, recommendation, staleness, table
        from skip_plugin_simulate.simulate import SPLIT_KEY, load, scenario, simulate_point, split_sweep

        if "=" in preset_name:  # no preset named: the first argument is an override
            preset_name, overrides = "default", (preset_name, *overrides)
        name, base = preset(preset_name)
        console = Console(width=max(Console().width, 160))
        measured = None
        if profile is not None:
            try:
                measured = read_profile(profile)
            except ConfigError as exc:
                raise click.UsageError(str(exc)) from None
            console.print(describe(measured, profile))
        names = list(schedules) or sorted(registry().kinds.get("schedules", {}))
        try:
            sim, _ = load(scenario(base, list(overrides), measured))
            theirs = next((w for w in sweeps if w.startswith(f"{SPLIT_KEY}=")), None)
            split = theirs or split_sweep(sim, shares)
            points = sweep_points((*sweeps, split) if split and not theirs else sweeps)
            first = split.split(",")[0] if split else None
            runs = [(point, schedule) for point in points for schedule in names]
            if check:  # every point's scenario validated as its run would load it
                for point in points:
                    load(scenario(base, [*overrides, *point], measured))
                listed = "; ".join(" ".join([schedule, *point]) for point, schedule in runs)
                console.print(f"skip simulate {name}: {len(runs)} runs: {listed}", markup=False)
                return
            results = []
            with progress(len(runs), "simulating", unit="runs") as advance:
                for point, schedule in runs:
                    results += simulate_point(base, overrides, point, [schedule], measured, first)
                    advance(note=" ".join([schedule, *point]))
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        c = sim.cluster
        steps = sim.trainer.total_training_steps
        console.print(table(results, f"skip simulate {name}: {steps} steps on {c.devices} devices"))
        if spread := staleness(results):
            console.print(spread)
        if sim.published is not None:
            console.print(published(results, sim.published, preset_point(base, points)))
        console.print(recommendation(results))
        path = plot(results, plot_path or Path("runs/simulate") / f"{name}.png")
        if path is not None:
            console.print(f"plot: {path}")
