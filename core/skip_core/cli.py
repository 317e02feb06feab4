"""The ``skip`` command: inspect plugins and caches; plugins add the rest (``skip run``, ``skip profile`` ...)."""

from __future__ import annotations

import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from skip_core import entries as cache_entries
from skip_core.console import console
from skip_core.errors import TRACEBACK_SWITCH, SkipError
from skip_core.escaping import printable
from skip_core.progress import progress


def _table(*columns: str, **options) -> Table:
    """A table whose cells wrap instead of being cut off (logs and pipes are 80 columns wide)."""
    table = Table(**options)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


class _Commands(click.Group):
    """The boundary of every ``skip`` command: a ``SkipError`` escaping one is printed as its one
    line (``Error: ...``, exit 1) with no traceback (``HYDRA_FULL_ERROR=1`` shows it). A command
    that a plugin of this repository would add, asked for while it is not installed, says which
    distribution brings it instead of click's bare "No such command"."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SkipError as exc:
            if os.environ.get(TRACEBACK_SWITCH) == "1":
                raise
            raise click.ClickException(printable(" ".join(str(exc).split()))) from None
        except click.ClickException as exc:  # any command's: its names may come from disk
            exc.message = printable(exc.message)
            raise

    def resolve_command(self, ctx: click.Context, args: list[str]):
        from skip_core.config import install_hint

        if args and self.get_command(ctx, args[0]) is None:
            words = [args[0]]
            while ctx.parent is not None:  # the subcommand's path below ``skip``: "cache import-verl"
                words.insert(0, ctx.info_name)
                ctx = ctx.parent
            if hint := install_hint("command", " ".join(words)):  # an error (exit 1), not a usage one
                command = " ".join(words)
                raise click.ClickException(f"`skip {command}` comes with a plugin that is not installed: {hint}")
        return super().resolve_command(ctx, args)


@click.group(cls=_Commands)
@click.version_option(package_name="skip-core")
def cli() -> None:
    """skip: skip, cache and replay stages of RL post-training."""
    warnings.formatwarning = _one_line_warning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as a user reads it: its category and message on one line, not the source line
    that raised it."""
    return f"{category.__name__}: {printable(' '.join(str(message).split()))}\n"


@cli.command()
def plugins() -> None:
    """List installed plugins: what each provides (roles, backends, tools ...) and the hooks it implements."""
    from skip_core.plugins import installed, pm, registry

    table = _table("distribution", "version", "plugin", "provides", "hooks")
    for name, dist, version, provided in installed():
        offered = [f"{kind[:-1].replace('_', ' ')} {item}" for kind, items in provided.items() for item in items]
        offered += [f"command {path}" for path in _added.get(name, ())]
        hooks = sorted(caller.name for caller in pm.get_hookcallers(pm.get_plugin(name)) or ())
        table.add_row(dist, version, name, ", ".join(offered) or "-", ", ".join(hooks))
    console.print(table)
    registry()  # a conflict between two plugins: listed above, and the command fails with its line


@cli.group(cls=_Commands)
def cache() -> None:
    """Inspect, verify, prune and import rollout caches."""


def _entries(directory: Path, deep: bool):
    """``(path, meta, problem)`` of each step directory, ``problem`` a ``CorruptEntry`` or ``None``;
    hashing them all (``deep``) shows its progress."""
    paths = list(cache_entries.scan(directory))
    with progress(len(paths), "verifying", unit="entries") if deep else nullcontext(None) as advance:
        for path in paths:
            try:
                yield path, cache_entries.verify(path, deep=deep, root=directory), None
            except cache_entries.CorruptEntry as exc:
                yield path, None, exc
            if advance is not None:
                advance()


def _entry_table(directory: Path, deep: bool) -> tuple[Table, int]:
    table = _table("role", "step", "samples", "MB", "status", "entry")
    bad = 0
    for path, meta, problem in _entries(directory, deep):
        bad += problem is not None
        meta = meta or {}
        size = sum(f["bytes"] for f in meta["files"].values()) / 1e6 if meta else 0.0
        ok = Text("ok" + ("" if deep else " (sizes)"), style="green")
        kind = "foreign" if isinstance(problem, cache_entries.ForeignEntry) else "corrupt"
        status = Text(f"{kind}: {problem}", style="red") if problem else ok
        # Text cells: names and reasons come from files on disk and must never be read as markup.
        where = str(path.relative_to(directory)) if path != directory else "."
        cells = (meta.get("role", "?"), path.name, meta.get("samples", "?"), f"{size:.1f}")
        table.add_row(*(Text(str(cell)) for cell in cells), status, Text(where))
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
    help="Seconds since a leftover temporary directory was last touched before it is removed, when the "
    "process that wrote it cannot be asked (another host, an older skip): it may be a dump in progress.",
)
def cache_prune(directory: Path, dry_run: bool, min_age: float) -> None:
    """Remove corrupt entries and leftovers of interrupted dumps under DIRECTORY: skip's own files in
    them only; what else they hold, and entries of other formats or versions, are left and named."""
    # A link is removed, never what it points to.
    doomed, foreign = [], []
    for path, _, problem in _entries(directory, deep=True):
        if isinstance(problem, cache_entries.ForeignEntry):
            foreign.append((path, problem))
        elif problem is not None:
            doomed.append((path, f"corrupt: {problem}"))
    for path, problem in foreign:
        console.print(f"left {path} as it is: {problem}", markup=False, highlight=False)
    now = time.time()
    for path in cache_entries.leftovers(directory):
        if cache_entries.abandoned_leftover(path) or now - path.lstat().st_mtime >= min_age:
            doomed.append((path, "leftover of an interrupted dump"))
    if dry_run:
        for path, why in doomed:
            console.print(f"would remove {path} ({why})", markup=False, highlight=False)
        console.print(f"{_count(len(doomed))} to remove")
        return
    failed = 0
    for path, why in doomed:
        if problem := _remove(path):
            failed += 1
            console.print(f"could not remove {path} ({why}): {problem}", markup=False, highlight=False)
        else:
            console.print(f"removed {path} ({why})", markup=False, highlight=False)
    console.print(f"{_count(len(doomed) - failed)} removed" + (f", {_count(failed)} could not be" if failed else ""))
    if failed:
        sys.exit(1)


def _count(n: int) -> str:
    return f"{n} director{'y' if n == 1 else 'ies'}"


def _remove(path: Path) -> str | None:
    """Delete skip's files of ``path`` and then it (a link itself, never its target); what went
    wrong, or ``None``."""
    try:
        if left := cache_entries.remove(path):
            return f"holds {', '.join(left)}, which skip did not write: left there"
    except OSError as exc:
        return exc.strerror or str(exc)
    return "still there" if os.path.lexists(path) else None


def _plugin_commands() -> None:
    """Let plugins add commands, noting which added what (``skip plugins`` lists it); one that
    fails to is reported, and the others still work."""
    import warnings

    from skip_core.plugins import distribution, load_plugins

    for impl in load_plugins().hook.skip_register_commands.get_hookimpls():
        before = _paths(cli)
        try:
            impl.function(cli=cli)
        except Exception as exc:
            plugin = distribution(impl.plugin_name)
            warnings.warn(f"skip: {plugin} failed to add its commands: {exc!r}", RuntimeWarning, stacklevel=1)
        added = _paths(cli) - before
        _added[impl.plugin_name] = sorted(path for path in added if path.rpartition(" ")[0] not in added)


def _paths(group: click.Group, prefix: str = "") -> set[str]:
    """Every command below ``group``, as the words that call it (``cache import-verl``)."""
    paths = set()
    for name, command in group.commands.items():
        paths.add(prefix + name)
        if isinstance(command, click.Group):
            paths |= _paths(command, f"{prefix}{name} ")
    return paths


# plugin name -> the commands it added, for ``skip plugins``
_added: dict[str, list[str]] = {}
_plugin_commands()
