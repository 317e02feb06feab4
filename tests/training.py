"""Helpers of the tests that train: the small run every test uses, and how to start one in
this process or as a separate ``skip run`` (for tests that kill it). The trainer is imported
when a helper runs, not with this module."""

import json
import sys
from pathlib import Path

from skiptests import CONFIGS

SMALL = [
    "task.train_size=64",
    "task.val_size=8",
    "task.warmup_steps=5",
    "data.train_batch_size=4",
    "data.max_response_length=64",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "actor.ppo_micro_batch_size=2",
    "trainer.val_before_train=false",
    "resources.num_cpus=2",
    "resources.torch_threads=1",
]


def overrides(task_dir, tmp_path, *more):
    return [
        *SMALL,
        f"task.dir={task_dir}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"skip.rollout.dump_dir={tmp_path / 'cache'}",
        f"skip.async_rollout.dump_dir={tmp_path / 'cache'}",
        *more,
    ]


def train(task_dir, tmp_path, *more):
    """``skip run`` in this process (Ray from the ``ray_session`` fixture): the trainer and its console output."""
    from rich.console import Console
    from skip_plugin_trainer.commands import compose_config
    from skip_plugin_trainer.train.trainer import run

    config = compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, *more)))
    console = Console(record=True, width=200)
    return run(config, console), console.export_text()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def undeclared_phases(trainer, rows: list[dict]) -> set[str]:
    """The phases ``rows`` time (``timing_s/<phase>``) that neither the run's schedule (its
    ``phases`` and ``background``) nor the trainer declares: none, by the trainer-schedule contract."""
    from skip_core.schedule import STEP
    from skip_plugin_trainer.train.trainer import stacked_phases

    timed = {key.removeprefix("timing_s/") for row in rows for key in row if key.startswith("timing_s/")}
    return timed - {STEP, *stacked_phases(trainer.schedule), *trainer.schedule.background}


def command(task_dir, tmp_path, *more):
    exe = Path(sys.executable).parent / "skip"
    return [str(exe), "run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *more)]


# `skip run` with one more plugin: its lookup of one step of a role (a trainer step's batch, or a
# streamed sample's feed index) touches a marker file and never returns, so the run stops there.
HELD_RUN = """
import sys, threading
from pathlib import Path
from skip_core import hookimpl
from skip_core.cli import cli
from skip_core.plugins import load_plugins

held_role, held_step, marker = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])


class Hold:
    @hookimpl(tryfirst=True)
    def skip_precondition(self, role, step):
        if role.name == held_role and step == held_step:
            marker.touch()
            threading.Event().wait()


load_plugins().register(Hold(), name="hold")
cli(sys.argv[4:])
"""


def held_command(task_dir, tmp_path, role: str, step: int, marker: Path, *more):
    """``command``, except that the run's lookup of ``role``'s step ``step`` touches ``marker`` and
    never returns: the run stops there for certain, as slow as the machine may be."""
    _, *args = command(task_dir, tmp_path, *more)
    return [sys.executable, "-c", HELD_RUN, role, str(step), str(marker), *args]


def fingerprints(cache: Path) -> dict[str, str]:
    from skip_core.entries import scan, verify

    return {p.name: verify(p)["fingerprint"] for p in scan(cache)}
