"""``skip run`` and ``skip rollout``: Hydra apps over the shipped ``run.yaml`` and ``rollout.yaml``."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from skip_core.console import console
from skip_core.escaping import printable

#: The package holding the shipped configs, for Hydra (``pkg://``).
CONFIGS_PACKAGE = "skip_plugin_trainer.config"
#: Longer than any key of any section (``actor_rollout_ref.rollout.multi_turn.tool_config_path``: 53).
MAX_KEY = 200


def register(cli: click.Group) -> None:
    rollout = "Generate one batch through the configured backend and agent loop, with OVERRIDES."
    cli.add_command(hydra_job("rollout", rollout, _rollout))
    cli.add_command(
        hydra_job("run", "Train with the configured schedule (GRPO on the embedded default), with OVERRIDES.", _run)
    )
    from skip_plugin_trainer.diff.cli import command

    cli.add_command(command(console))


def _rollout(config: Any, console: Console) -> None:
    from skip_plugin_trainer.rollout.job import run

    run(config, console)


def _run(config: Any, console: Console) -> None:
    from skip_plugin_trainer.train.trainer import run

    run(config, console)


def hydra_job(name: str, help: str, job: Callable[[Any, Console], Any]) -> click.Command:
    """A command composing ``<name>.yaml`` with Hydra overrides, as the design doc shows.

    The configs ship inside this package (``skip_plugin_trainer/configs``), so the command works
    from any directory; ``--config-dir`` puts a user's directory in front of them. ``--check``
    validates and prints the settings without starting anything; ``--cfg job`` prints the
    composed config, as Hydra's apps (verl's) do.
    """

    @click.command(name=name, help=help, context_settings={"ignore_unknown_options": True})
    @click.argument("overrides", nargs=-1)
    @click.option(
        "--config-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="A directory of your own Hydra configs, searched before the shipped ones (whose run.yaml and "
        "rollout.yaml a config there can include with `defaults: [run, _self_]`).",
    )
    @click.option("--config-name", default=name, show_default=True)
    @click.option(
        "--check",
        is_flag=True,
        help="Validate the whole configuration as the command would (sections, cross-checks, task, data), "
        "print the resolved settings as YAML and exit, starting nothing.",
    )
    @click.option(
        "--cfg",
        type=click.Choice(["job"]),
        default=None,
        help="Print the composed config (Hydra's --cfg job) and exit.",
    )
    @click.option("--resolve", is_flag=True, help="With --cfg: resolve the config's interpolations first.")
    def command(overrides: tuple[str, ...], config_dir: Path | None, config_name: str, **flags: Any) -> None:
        from skip_plugin_trainer.train.resume import RunStopped

        config = compose_config(config_dir, config_name, overrides)
        if flags["cfg"] is not None:
            from omegaconf import OmegaConf

            console.print(OmegaConf.to_yaml(config, resolve=flags["resolve"]).rstrip(), soft_wrap=True, markup=False)
            return
        if flags["check"]:
            from skip_plugin_trainer.check import check as check_config

            check_config(config, console, name)
            return
        try:  # any other skip error is one line at the ``skip`` command's boundary (skip_core.cli)
            job(config, console)
        except RunStopped as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            again = [*(["--config-dir", str(config_dir)] if config_dir else []), *overrides]
            if config_name != name:
                again[:0] = ["--config-name", config_name]
            raise click.ClickException(how_to_resume(exc, name, again)) from None

    return command


def how_to_resume(exc: Any, name: str, args: list[str]) -> str:
    """One line for a run that lost a worker it cannot do without: what died, and the command
    (``skip <name> <args>`` again, resuming wherever it was told not to) that goes on from the
    newest checkpoint."""
    kept = [a for a in args if not a.startswith(("trainer.resume_mode=", "trainer.resume_from_path="))]
    if len(kept) < len(args):  # told to start over, or from a given path: the newest checkpoint now
        kept.append("trainer.resume_mode=auto")
    again = shlex.join(["skip", name, *kept])
    where = (
        f"resume from the newest checkpoint ({exc.checkpoint}) with `{again}`"
        if exc.checkpoint is not None
        else f"no checkpoint was saved yet (trainer.save_freq): `{again}` starts over"
    )
    return f"skip {name} stopped at {exc}; {where} (HYDRA_FULL_ERROR=1 shows the traceback)"


def compose_config(config_dir: Path | None, config_name: str, overrides: tuple[str, ...]) -> Any:
    """The config ``config_name`` from ``config_dir`` (searched first) or the shipped configs.

    Hydra finds a primary config only in its primary source: the user's directory is that
    source when it holds ``config_name``, and the shipped configs come after it on the search
    path (for its ``defaults``); otherwise the shipped configs are, and the user's directory follows.
    Every override is applied as Hydra's ``++`` (set or add): whether a key exists is for the one
    validation pass to say (``RunSettings.from_config``), in one line, whatever prefix it came with.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.errors import HydraException, MissingConfigException
    from skip_core.hydra_defaults import register_hydra_defaults

    register_hydra_defaults()
    if config_dir is not None and not config_dir.is_dir():
        raise click.UsageError(f"--config-dir: no such directory {str(config_dir.resolve())!r}")
    if config_dir is not None and (config_dir / f"{config_name}.yaml").is_file():
        context = initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None)
        search = [f"hydra.searchpath=[pkg://{CONFIGS_PACKAGE}]"]
    else:
        context = initialize_config_module(CONFIGS_PACKAGE, version_base=None)
        search = [f"hydra.searchpath=[file://{config_dir.resolve()}]"] if config_dir is not None else []
    with context:
        try:
            return compose(config_name=config_name, overrides=[*search, *forced(overrides)])
        except MissingConfigException:
            raise click.UsageError(_no_config(config_dir, config_name)) from None
        except HydraException as exc:
            raise click.UsageError(str(exc)) from None


def forced(overrides: tuple[str, ...]) -> list[str]:
    """``overrides`` as Hydra's ``++key=value``; deletions (``~key``) and ``hydra.*`` as given.
    Two spellings of one key (``rollout.n=3 actor_rollout_ref.rollout.n=5``) are an error, since
    which one wins would depend on where each lands, not on their order."""
    from skip_core.config import ConfigError

    from skip_plugin_trainer.config.verl_keys import alias

    out, seen = [], {}
    # verl's null for one spelling (ppo_micro_batch_size=null beside ppo_micro_batch_size_per_gpu=8,
    # as its scripts write) leaves the key to the other, as verl reads them
    given = [(o.partition("=")[0].lstrip("+"), o.partition("=")[2]) for o in overrides if "=" in o]
    spelled = {alias(key) for key, value in given if value.strip() != "null"}
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or key.startswith(("~", "hydra.")):
            out.append(override)
            continue
        key = key.lstrip("+")
        if len(key) > MAX_KEY:  # Hydra would look for a config group file of that name: ENAMETOOLONG
            raise ConfigError(f"{printable(key[:60])}...: a key of {len(key)} characters, which no section has")
        target = alias(key)
        if value.strip() == "null" and target in spelled:
            continue  # another spelling gives it a value
        if seen.setdefault(target, key) != key:
            raise ConfigError(f"{key}: sets {target}, which {seen[target]} sets too; give it once")
        missing = _missing_section(target)
        if missing:
            raise ConfigError(f"{key}: {missing}")
        out.append(f"++{key}={value}")
    return out


def _missing_section(key: str) -> str | None:
    """For a key of a section a plugin of this repository declares, while that plugin is not
    installed: where the section comes from. (The shipped configs may carry such a section; an
    override of it would do nothing.)"""
    from skip_core.config import PLUGIN_FOLDERS, install_hint
    from skip_core.plugins import registry

    declared = registry().sections
    for kind, section in PLUGIN_FOLDERS:
        if kind == "section" and section not in declared and (key == section or key.startswith(f"{section}.")):
            return f"{section} comes with a plugin that is not installed: {install_hint('section', section)}"
    return None


def _no_config(config_dir: Path | None, config_name: str) -> str:
    import importlib.resources

    files = importlib.resources.files(CONFIGS_PACKAGE).iterdir()
    shipped = ", ".join(sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml")))
    where = f"{config_dir.resolve()} or " if config_dir is not None else ""
    return f"--config-name: no {config_name}.yaml in {where}the shipped configs ({shipped})"
