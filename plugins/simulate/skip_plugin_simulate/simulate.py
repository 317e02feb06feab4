"""Run an installed schedule against the simulated trainer, and sum up what it did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from skip_core.config import ConfigError, lookup, parse_section
from skip_core.plugins import registry
from skip_core.sections import Sections, parse_sections

from skip_plugin_simulate.clock import Clock
from skip_plugin_simulate.config import Simulation
from skip_plugin_simulate.measured import Measured
from skip_plugin_simulate.run import Checkpoint, Crash, SimulatedRun, Timeline
from skip_plugin_simulate.workload import VALIDATION_SEED, Workload


@dataclass(frozen=True)
class Summary:
    schedule: str
    steps: int
    wall_s: float
    step_s: float
    samples_per_s: float
    trainer_idle: float
    rollout_busy: float
    staleness: dict[int, float]  # updates behind -> share of the trained samples
    partial_ratio: float

    @property
    def staleness_mean(self) -> float:
        return sum(k * share for k, share in self.staleness.items())

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)


@dataclass(frozen=True)
class Result:
    """One schedule at one sweep point."""

    summary: Summary
    point: list[str]  # the sweep's overrides this run had
    timeline: Timeline

    @property
    def settings(self) -> str:
        """The sweep point, each key by its last part (``rollout_devices=32``)."""
        return " ".join(_short(override) for override in self.point)

    @property
    def label(self) -> str:
        return f"{self.summary.schedule} {self.settings}".strip()


def _short(override: str) -> str:
    key, _, value = override.partition("=")
    return f"{key.rpartition('.')[2]}={value}"


#: The rollout:trainer split: the devices an overlapped schedule gives its engines.
SPLIT_KEY = "cluster.rollout_devices"


def load(config: Any) -> tuple[Simulation, Sections]:
    """The simulation's own keys, and the schedules' sections (``async_training`` ...) as each
    plugin declares them; a bad key is a ``ConfigError`` naming it."""
    raw = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config)
    own = {key: value for key, value in raw.items() if key in Simulation.model_fields}
    sim = parse_section(Simulation, "", own)  # one line naming the key, as every config error
    declared = registry().kinds.get("sections", {})
    theirs = {key: model for key, model in declared.items() if key.split(".")[0] not in Simulation.model_fields}
    return sim, parse_sections(raw, theirs)


def simulate(
    sim: Simulation,
    schedule: str,
    sections: Sections,
    workload: Workload | None = None,
    val_workload: Workload | None = None,
    resume: Checkpoint | None = None,
    crash_at: int = 0,
) -> Timeline:
    """``schedule`` (any installed schedule plugin) trains the simulated run to its end, or up
    to ``crash_at``, where it fails with ``Crash``; the timeline holds what it did until then."""
    plan = _plan(schedule, sections)
    run = SimulatedRun(sim, plan.overlapped, Clock(), workload, val_workload, resume, crash_at)
    try:
        run.clock.run(lambda: plan.fit(run))
    except Crash:
        run.timeline.crashed = True
    return run.timeline


def _plan(schedule: str, sections: Sections) -> Any:
    return lookup("--schedule", "schedule", schedule, registry().kinds.get("schedules", {}))(sections)


def overlapped(schedule: str, sections: Sections) -> bool:
    """Whether ``schedule`` generates beside training, on its share of the devices."""
    return _plan(schedule, sections).overlapped


def summarize(schedule: str, timeline: Timeline) -> Summary:
    rows = timeline.rows
    wall = rows[-1]["time_s"] - (rows[0]["time_s"] - rows[0]["timing_s/step"]) if rows else 0.0

    def mean(key: str) -> float:
        return sum(row.get(key, 0.0) for row in rows) / len(rows) if rows else 0.0

    samples = sum(row["samples"] for row in rows)
    return Summary(
        schedule=schedule,
        steps=len(rows),
        wall_s=wall,
        step_s=mean("timing_s/step"),
        samples_per_s=samples / wall if wall else 0.0,
        trainer_idle=mean("trainer/idle_ratio"),
        rollout_busy=mean("rollout/busy_ratio"),
        staleness={k: n / samples for k, n in sorted(timeline.staleness.items())},
        partial_ratio=sum(row["partial_samples"] for row in rows) / samples if samples else 0.0,
    )


def overrides_to_config(base: Mapping[str, Any], overrides: list[str]) -> Any:
    """A preset's keys with ``key=value`` overrides on top (OmegaConf's dotlist syntax)."""
    return OmegaConf.merge(OmegaConf.create(dict(base)), OmegaConf.from_dotlist(list(overrides)))


def scenario(base: Mapping[str, Any], overrides: list[str], measured: Measured | None = None) -> Any:
    """A preset's keys, what a profile measured on top of them, then the overrides."""
    if measured is not None:
        base = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(dict(base)), measured.overrides()))
    return overrides_to_config(base, overrides)


def simulate_all(
    base: Mapping[str, Any], overrides: list[str], schedules: list[str], measured: Measured | None = None
) -> tuple[Simulation, dict[str, Timeline]]:
    """Each schedule on one ``scenario``; every schedule sees the same samples."""
    sim, sections = load(scenario(base, overrides, measured))
    return sim, _simulate_each(sim, sections, schedules, measured)


def _simulate_each(
    sim: Simulation, sections: Sections, schedules: list[str], measured: Measured | None
) -> dict[str, Timeline]:
    groups, val_groups = (measured.groups, measured.val_groups) if measured else (None, None)
    workload = Workload(sim.requests, sim.trainer.seed, groups)
    val_workload = Workload(sim.requests, sim.trainer.seed + VALIDATION_SEED, val_groups)
    return {name: simulate(sim, name, sections, workload, val_workload) for name in schedules}


def split_sweep(sim: Simulation, shares: str) -> str | None:
    """The rollout:trainer splits a recommendation tries, as a ``--sweep``: the scenario's own
    and each share of the devices, in whole engines (one engine and one trainer device at least)."""
    if shares.strip().lower() == "none":
        return None
    per, devices = sim.engines.devices_per_engine, sim.cluster.devices
    values = {sim.cluster.rollout_devices}
    for share in shares.split(","):
        try:
            fraction = float(share)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction < 1:
            raise ConfigError(f"--split: {share!r} is not a share between 0 and 1 (or give none)")
        value = max(1, round(fraction * devices / per)) * per
        if value < devices:
            values.add(value)
    return f"{SPLIT_KEY}={','.join(map(str, sorted(values)))}" if len(values) > 1 else None


def simulate_point(
    base: Mapping[str, Any],
    overrides: list[str],
    point: list[str],
    schedules: list[str],
    measured: Measured | None = None,
    first_split: str | None = None,
) -> list[Result]:
    """The schedules at one sweep ``point``. A colocated schedule that does not overlap uses
    every device whatever the split, so it runs only at the sweep's ``first_split``
    (``key=value``), as the baseline of every split."""
    sim, sections = load(scenario(base, [*overrides, *point], measured))
    same_anywhere = {s for s in schedules if sim.cluster.colocated and not overlapped(s, sections)}
    here = [s for s in schedules if first_split is None or first_split in point or s not in same_anywhere]
    timelines = _simulate_each(sim, sections, here, measured)
    return [Result(summarize(name, timeline), point, timeline) for name, timeline in timelines.items()]
