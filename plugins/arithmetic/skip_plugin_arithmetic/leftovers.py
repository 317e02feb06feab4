"""Temporary names that say which process writes them, and the removal of those a killed build left.

Every piece of the task directory is written beside its target and renamed into place, so a
reader never sees half of one. A build killed before the rename (SIGKILL, a lost node, an
out-of-memory kill) leaves its hidden temporary behind for good: a directory of model weights,
a parquet file. Named with ``skip_core.files.owned`` (``<pid>@<host>-`` after the prefix), the
next prepare can tell a leftover, whose process is gone, from the work of a build still running
beside it, and removes only the leftover. Names without that mark (written before it existed)
and names from other hosts are never removed: nobody can say whether they are still in use.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from skip_core.files import owned, remove_abandoned


def partial_prefix(target: Path) -> str:
    """Where the directory ``target`` is built before it is renamed: ``.<name>.partial-``."""
    return f".{Path(target).name}.partial-"


def temporary_prefix(path: Path) -> str:
    """Where ``skip_core.writing`` writes the file ``path`` before it is renamed: ``.<name>.``."""
    return f".{Path(path).name}."


def partial_directory(target: Path) -> Path:
    """A fresh directory beside ``target`` to build it in, named as this process's."""
    return Path(tempfile.mkdtemp(prefix=owned(partial_prefix(target)), dir=Path(target).parent))


def remove(files: Iterable[Path] = (), directories: Iterable[Path] = ()) -> list[Path]:
    """Remove what killed builds of these files and directories left beside them; return it."""
    prefixes: dict[Path, list[str]] = {}
    for path in files:
        prefixes.setdefault(Path(path).parent, []).append(temporary_prefix(path))
    for path in directories:
        prefixes.setdefault(Path(path).parent, []).append(partial_prefix(path))
    return sorted(gone for parent, names in prefixes.items() for gone in remove_abandoned(parent, tuple(names)))


def say(removed: list[Path], progress: bool, log: Path | None) -> None:
    """One line naming what was removed: printed with ``progress``, appended to ``log`` when given."""
    if not removed:
        return
    line = f"removed what interrupted builds left: {', '.join(str(path) for path in removed)}"
    if progress:
        print(line, flush=True)
    if log is not None:
        try:
            with open(log, "a", encoding="utf-8") as file:
                file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:  # the removal is done; a log we cannot append to is no reason to stop
            pass
