"""The ``skip`` command: inspect plugins and caches, roll out, run the main job."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from skip_core import store as cache_store

# Pipes and CI logs get 80 columns by default, which would fold every path; give them room.
console = Console(width=None if Console().is_terminal else 160)


def _table(*columns: str, **options) -> Table:
    """A table whose cells wrap instead of being cut off (logs and pipes are 80 columns wide)."""
    table = Table(**options)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


@click.group()
@click.version_option(package_name="skip-core")
def cli() -> None:
    """skip: skip, cache and replay stages of RL post-training."""


@cli.command()
def plugins() -> None:
    """List installed plugins: what each provides (roles, backends, tools ...) and the hooks it implements."""
    from skip_core.plugins import installed, pm

    table = _table("distribution", "version", "plugin", "provides", "hooks")
    for name, dist, version, provided in installed():
        kinds = ("roles", "backends", "schedules", "tools", "tool_parsers", "tasks", "rewards")
        offered = [f"{kind[:-1].replace('_', ' ')} {item}" for kind in kinds for item in getattr(provided, kind)]
        table.add_row(
            dist,
            version,
            name,
            ", ".join(offered) or "-",
            ", ".join(sorted(caller.name for caller in pm.get_hookcallers(pm.get_plugin(name)) or ())),
        )
    console.print(table)


@cli.group()
def cache() -> None:
    """Inspect, verify, prune and import rollout caches."""


def _entries(directory: Path, deep: bool):
    for path in cache_store.scan(directory):
        try:
            meta = cache_store.verify(path, deep=deep)
            yield path, meta, None
        except cache_store.CorruptEntry as exc:
            yield path, None, str(exc)


def _entry_table(directory: Path, deep: bool) -> tuple[Table, int]:
    table = _table("role", "step", "samples", "MB", "status", "entry")
    bad = 0
    for path, meta, problem in _entries(directory, deep):
        bad += problem is not None
        meta = meta or {}
        size = sum(f.get("bytes", 0) for f in (meta.get("files") or {}).values()) / 1e6
        if problem:
            status = Text(f"corrupt: {problem}", style="red")
        else:
            status = Text("ok" + ("" if deep else " (sizes)"), style="green")
        # Text cells: names and reasons come from files on disk and must never be read as markup.
        table.add_row(
            Text(str(meta.get("role", "?"))),
            Text(path.name),
            Text(str(meta.get("samples", "?"))),
            f"{size:.1f}",
            status,
            Text(str(path.relative_to(directory)) if path != directory else "."),
        )
    return table, bad


@cache.command("ls")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def cache_ls(directory: Path) -> None:
    """List cache entries under DIRECTORY (sizes checked; use verify for hashes)."""
    table, _ = _entry_table(directory, deep=False)
    console.print(table)


@cache.command("verify")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def cache_verify(directory: Path) -> None:
    """Check every entry's files against its recorded sizes and hashes; exit 1 if any is bad."""
    table, bad = _entry_table(directory, deep=True)
    console.print(table)
    if bad:
        console.print(f"[red]{bad} corrupt entr{'y' if bad == 1 else 'ies'}[/red]")
        sys.exit(1)
    console.print(f"all {table.row_count} entries verified")


@cache.command("prune")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Only print what would be removed.")
@click.option(
    "--min-age",
    default=3600.0,
    show_default=True,
    help="Seconds since a leftover temporary directory was last touched before it is removed "
    "(younger ones may belong to a dump in progress).",
)
def cache_prune(directory: Path, dry_run: bool, min_age: float) -> None:
    """Remove corrupt entries and leftovers of interrupted dumps under DIRECTORY."""
    doomed = [(p, f"corrupt: {why}") for p, _, why in _entries(directory, deep=True) if why]
    now = time.time()
    for path in cache_store.leftovers(directory):
        if now - path.stat().st_mtime >= min_age:
            doomed.append((path, "leftover of an interrupted dump"))
    for path, why in doomed:
        console.print(f"{'would remove' if dry_run else 'removing'} {path} ({why})", markup=False, highlight=False)
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
    console.print(f"{len(doomed)} director{'y' if len(doomed) == 1 else 'ies'} {'to remove' if dry_run else 'removed'}")


@cache.command("import-verl")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="Required: verl's gen_batch.dp files are pickles, and reading a pickle can run code. "
    "Only convert dumps you made yourself or fully trust.",
)
@click.option(
    "--experiment-name",
    default=None,
    help="verl's trainer.experiment_name, for a {experiment}_{project} directory name that splits more than one way.",
)
@click.option("--project-name", default=None, help="verl's trainer.project_name (see --experiment-name).")
@click.option(
    "--role",
    type=click.Choice(["rollout", "async_rollout"]),
    default="rollout",
    show_default=True,
    help="Role of the entries: verl's async_rollout dumps have the same layout, with feed indices as steps.",
)
def cache_import_verl(
    src: Path, dst: Path, trust_pickle: bool, experiment_name: str | None, project_name: str | None, role: str
) -> None:
    """Convert verl's gen_batch.dp dumps under SRC into verified skip entries under DST."""
    if not trust_pickle:
        raise click.UsageError(
            "verl dumps are pickles and can execute code when read; pass --trust-pickle "
            "if you made these files yourself or trust their source"
        )
    from skip_core.verl_import import import_verl

    written = import_verl(
        src,
        dst,
        # lines quote paths and names read from the dump: never rich markup
        echo=lambda line: console.print(line, markup=False, highlight=False),
        experiment_name=experiment_name,
        project_name=project_name,
        role=role,
    )
    console.print(f"imported {len(written)} entr{'y' if len(written) == 1 else 'ies'} into {dst}", markup=False)
    if written.failed:
        sys.exit(1)


def hydra_job(name: str, help: str) -> Callable:
    """A command composing ``configs/<name>.yaml`` with Hydra overrides, as the design doc shows.

    Relative paths in configs can start from ``${config_dir:}``, the directory of the configs.
    """

    def decorate(job: Callable[[Any, Console], Any]) -> click.Command:
        @cli.command(name=name, help=help, context_settings={"ignore_unknown_options": True})
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

            config = _compose(config_dir, config_name, overrides)
            try:
                job(config, console)
            except ConfigError as exc:
                raise click.ClickException(str(exc)) from None

        return command

    return decorate


def _compose(config_dir: Path, config_name: str, overrides: tuple[str, ...]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from skip_core.config import register_hydra_defaults

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


@hydra_job("rollout", "Generate one batch through the configured backend and agent loop, with OVERRIDES.")
def rollout(config: Any, console: Console) -> None:
    from skip_core.rollout import run

    run(config, console)


@hydra_job("run", "Train with the configured schedule (GRPO on the embedded default), with OVERRIDES.")
def run(config: Any, console: Console) -> None:
    from skip_core.trainer import run

    run(config, console)


def _plugin_commands() -> None:
    """Let plugins add commands; one that fails to is reported, and the others still work."""
    import warnings

    from skip_core.plugins import distribution, load_plugins

    for impl in load_plugins().hook.skip_register_commands.get_hookimpls():
        try:
            impl.function(cli=cli)
        except Exception as exc:
            plugin = distribution(impl.plugin_name)
            warnings.warn(f"skip: {plugin} failed to add its commands: {exc!r}", RuntimeWarning, stacklevel=1)


_plugin_commands()
