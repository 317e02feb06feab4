"""A step directory of the cache (``skip_core.store``) on its own: the files one holds, how it is
checked (``verify``: every file read as hostile), sealed as it is written, and found under a
dump directory (``scan``, ``leftovers``)."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from skip_core import encoding, reading
from skip_core.config import Namespace
from skip_core.files import abandoned

FORMAT = "skip-cache"
VERSION = 1
META = "meta.json"
DATA_FILES = frozenset({encoding.TENSORS, encoding.DATA})
#: What a step directory of this format holds, all skip ever removes from one.
OWN_FILES = DATA_FILES | {META}
MAX_META_BYTES = 1 << 20
#: data.json holds a batch's non-tensor data (messages, tool calls): larger is refused unread.
MAX_DATA_BYTES = 1 << 30
SHAPE_PATTERN = re.compile(r"GBS\d+_N\d+_in\d+_out\d+")
GENERATION = re.compile(r"generation_[0-9]{1,9}")
STEP_NAME = re.compile(r"[0-9]{1,18}")  # int() takes other scripts' digits, and 5,000 of them
LEFTOVER_PREFIXES = (".tmp-", ".trash-")


class CorruptEntry(Exception):
    """A step directory that must not be loaded; the message says why, ``path`` which."""

    def __init__(self, reason: str, path: Path | None = None) -> None:
        super().__init__(reason)
        self.path = path


class ForeignEntry(CorruptEntry):
    """A step directory that is not this skip's to load, replace or prune: it holds files skip
    does not write (a verl dump, a user's), or it records another format or version."""


def path_kind(path: Path) -> str | None:
    """``"directory"``, ``"link"``, ``"other"`` or ``None`` when absent, from one ``lstat``:
    another writer may be replacing ``path`` meanwhile."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "directory" if stat.S_ISDIR(mode) else "link" if stat.S_ISLNK(mode) else "other"


def foreign_files(path: Path) -> list[str]:
    """What a step directory holds that skip does not write: other names (a verl dump's
    ``gen_batch.dp``), and directories under skip's names (``data.json/``, holding anything);
    a link is never listed through."""
    if os.path.islink(path):
        return []
    try:  # another writer may be replacing it right now
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(f"{name}/" if name in OWN_FILES else name for name in names if not _removable(path, name))


def _removable(directory: Path, name: str) -> bool:
    """One of skip's names, and not a directory: a file skip wrote, or a link or pipe planted
    there, which unlinking removes without touching what it points to."""
    try:
        return name in OWN_FILES and not stat.S_ISDIR(os.lstat(directory / name).st_mode)
    except FileNotFoundError:
        return True


def remove(path: Path) -> list[str]:
    """Delete a step directory skip wrote (an entry, or the temporary or trash directory of one):
    its own files (``OWN_FILES``, never a directory), then the directory once it is empty. What
    is left, named in the result, is someone else's and stays, with the directory; a link is
    removed itself. Never recursive, so never deeper than one level."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return []
    left = foreign_files(path)
    for name in sorted(OWN_FILES):
        if _removable(path, name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path / name)
    if not left:
        os.rmdir(path)
    return left


def verify(
    path: Path,
    role: str | None = None,
    namespace: Namespace | None = None,
    deep: bool = True,
    root: Path | None = None,
) -> dict:
    """Check one step directory against its ``meta.json``; return the meta or raise ``CorruptEntry``.

    Every file is read through ``skip_core.reading``: regular, not a link, inside ``root`` (the
    dump directory; by default the step directory's parent), no larger than recorded.
    ``deep=False`` checks sizes only (for listings); loading always checks hashes too.
    """
    path = Path(path)
    root = path.parent if root is None else root
    kind = path_kind(path)
    if kind is None:
        raise CorruptEntry("incomplete: the step directory is gone", path)
    if kind == "link":
        raise CorruptEntry("the step directory is a symbolic link; skip never follows links in a cache", path)
    if kind != "directory":
        raise CorruptEntry("not a directory", path)
    if other := foreign_files(path):
        raise ForeignEntry(f"holds {', '.join(other)}, which skip did not write", path)
    meta = _read_meta(path / META, root)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ForeignEntry(
            f"written as format {meta.get('format')!r} version {meta.get('version')!r}, which this skip "
            f"(format {FORMAT!r} version {VERSION}) neither reads nor replaces",
            path,
        )
    if str(meta.get("step")) != path.name:
        raise CorruptEntry(f"meta.json records step {meta.get('step')!r} in directory {path.name!r}", path)
    if role is not None and meta.get("role") != role:
        raise CorruptEntry(f"written for role {meta.get('role')!r}, not {role!r}", path)
    if namespace is not None and meta.get("namespace") != dataclasses.asdict(namespace):
        raise CorruptEntry(f"written by another run: namespace {meta.get('namespace')!r}", path)
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != DATA_FILES:
        raise CorruptEntry(f"meta.json lists files {sorted(files) if isinstance(files, dict) else files!r}", path)
    for name, expected in files.items():
        _check_file(path / name, expected, deep, root)
    return meta


def _read_meta(path: Path, root: Path) -> dict:
    try:
        meta = reading.read_json(path, MAX_META_BYTES, root)
    except FileNotFoundError:
        raise CorruptEntry("incomplete: meta.json is missing", path.parent) from None
    except reading.UnsafeFile as exc:
        raise CorruptEntry(str(exc), path.parent) from None
    except (OSError, ValueError) as exc:
        raise CorruptEntry(f"cannot read meta.json: {exc}", path.parent) from None
    if not isinstance(meta, dict):
        raise CorruptEntry("meta.json is not an object", path.parent)
    return meta


def _check_file(path: Path, expected: Any, deep: bool, root: Path) -> None:
    size = expected.get("bytes") if isinstance(expected, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptEntry(f"meta.json entry for {path.name} is malformed", path.parent)
    limit = MAX_DATA_BYTES if path.name == encoding.DATA else None
    if limit is not None and size > limit:
        raise CorruptEntry(f"{path.name} records {size} bytes, more than the {limit} allowed", path.parent)
    try:
        with reading.opened(path, limit, root) as fd:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise CorruptEntry(f"{path.name} has {actual} bytes, meta.json records {size}", path.parent)
            if deep and fd_digest(fd) != expected.get("xxh3_128"):
                raise CorruptEntry(f"{path.name} does not match its recorded hash", path.parent)
    except reading.UnsafeFile as exc:
        raise CorruptEntry(str(exc), path.parent) from None
    except OSError as exc:
        raise CorruptEntry(f"cannot read {path.name}: {exc}", path.parent) from None


def file_digest(path: Path) -> str:
    """xxh3-128 of a file, read through a memory map (no copy into Python)."""
    with open(path, "rb") as f:
        return fd_digest(f.fileno())


def fd_digest(fd: int) -> str:
    """xxh3-128 of the file open at ``fd``, read through a memory map."""
    if os.fstat(fd).st_size == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        return xxhash.xxh3_128_hexdigest(view)


def seal(path: Path) -> dict:
    """fsync a written file while hashing it (fsync releases the GIL): size and hash for meta."""
    fd = os.open(path, os.O_RDONLY)
    errors: list[OSError] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            errors.append(exc)

    syncer = threading.Thread(target=sync)
    syncer.start()
    try:
        digest = file_digest(path)
    finally:
        syncer.join()
        os.close(fd)
    if errors:
        raise errors[0]
    return {"bytes": path.stat().st_size, "xxh3_128": digest}


def scan(root: Path) -> Iterator[Path]:
    """Every step directory under ``root`` (a dump_dir or any directory inside one), the extra
    generations' included, and every link or file named like one (which ``verify`` refuses);
    links are never followed."""
    root = Path(root)
    if STEP_NAME.fullmatch(root.name) and _holds_steps(root.parent):
        yield root
        return
    for here, dirnames, filenames in reading.walk(root):
        if _holds_steps(here):
            steps = {name for name in (*dirnames, *filenames) if STEP_NAME.fullmatch(name)}
            yield from (here / name for name in sorted(steps, key=lambda n: (len(n), n)))
            dirnames[:] = sorted(n for n in dirnames if GENERATION.fullmatch(n) and not (here / n).is_symlink())
        else:
            dirnames.sort()


def _holds_steps(directory: Path) -> bool:
    """A namespace directory (``GBS..._N..._in..._out...``) or a generation's inside one."""
    name = directory.name
    return bool(
        SHAPE_PATTERN.fullmatch(name) or (GENERATION.fullmatch(name) and SHAPE_PATTERN.fullmatch(directory.parent.name))
    )


def abandoned_leftover(path: Path) -> bool:
    """Whether a leftover (``leftovers``) was written by a process of this host that is gone."""
    return any(abandoned(path.name, prefix) for prefix in LEFTOVER_PREFIXES)


def leftovers(root: Path) -> Iterator[Path]:
    """Temporary and trash directories left by interrupted dumps under ``root``."""
    for here, dirnames, _ in reading.walk(root):
        for name in list(dirnames):
            if name.startswith(LEFTOVER_PREFIXES):
                dirnames.remove(name)
                yield here / name
