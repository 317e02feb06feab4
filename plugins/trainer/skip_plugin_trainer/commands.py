"""``skip run`` and ``skip rollout``: Hydra apps over ``configs/run.yaml`` and ``configs/rollout.yaml``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

# Pipes and CI logs get 80 columns by default, which would fold every path; give them room.
console = Console(width=None if Console().is_terminal else 160)


def register(cli: click.Group) -> None:
    rollout = "Generate one batch through the configured backend and agent loop, with OVERRIDES."
    cli.add_command(hydra_job("rollout", rollout, _rollout))
    cli.add_command(
        hydra_job("run", "Train with the configured schedule (GRPO on the embedded default), with OVERRIDES.", _run)
    )


def _rollout(config: Any, console: Console) -> None:
    from skip_plugin_trainer.rollout.job import run

    run(config, console)


def _run(config: Any, console: Console) -> None:
    from skip_plugin_trainer.train.trainer import run

    run(config, console)


def hydra_job(name: str, help: str, job: Callable[[Any, Console], Any]) -> click.Command:
    """A command composing ``configs/<name>.yaml`` with Hydra overrides, as the design doc shows.

    Relative paths in configs can start from ``${config_dir:}``, the directory of the configs.
    """

    @click.command(name=name, help=help, context_settings={"ignore_unknown_options": True})
    @click.argument("overrides", nargs=-1)
    @click.option(
        "--config-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("configs"),
        show_default=True,
        help="Directory holding the Hydra configs.",
    )
    @click.option("--config-name", default=name, show_default=True)
    def command(overrides: tuple[str, ...], config_dir: Path, config_name: str) -> None:
        from skip_core.config import ConfigError

        config = compose_config(config_dir, config_name, overrides)
        try:
            job(config, console)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None

    return command


def compose_config(config_dir: Path, config_name: str, overrides: tuple[str, ...]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from skip_core.hydra_defaults import register_hydra_defaults

    if not (config_dir / f"{config_name}.yaml").is_file():
        raise click.UsageError(f"no config {config_name}.yaml in {config_dir.resolve()} (set --config-dir)")
    register_hydra_defaults()
    OmegaConf.register_new_resolver("config_dir", lambda: str(config_dir.resolve()), replace=True)
    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        try:
            return compose(config_name=config_name, overrides=list(overrides))
        except HydraException as exc:
            unknown = _unknown_key(exc, compose(config_name=config_name))
            if unknown:
                raise click.ClickException(unknown) from None
            raise click.UsageError(str(exc)) from None


def _unknown_key(exc: Exception, base: Any) -> str | None:
    """Our one-line error for an override of a key the config lacks, instead of Hydra's advice to
    add it with ``+`` (which only leads to the same error from the run's own validation)."""
    import difflib

    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not cause.full_key:
        return None
    parent_key, _, name = cause.full_key.rpartition(".")
    parent = OmegaConf.select(base, parent_key) if parent_key else base
    if not isinstance(parent, DictConfig):
        return None
    keys = sorted(str(key) for key in parent)
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f"; did you mean {parent_key + '.' if parent_key else ''}{close[0]}?" if close else ""
    return f"{cause.full_key}: unknown key (allowed: {', '.join(keys)}){hint}"
