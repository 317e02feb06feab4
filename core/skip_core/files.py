"""Durable file writes: complete or absent after a crash, with the modes the user's umask gives.

``tempfile`` creates private files (0600) and directories (0700) so that nobody else can
read a half-written one; renamed into place they would keep that mode, and a colleague
could not read a shared cache or checkpoint. Everything here is given the mode ``open()`` or
``mkdir()`` would have given it before it is published.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from skip_core.errors import SkipError

#: A path written ``pkg://<package>/<file>`` names a file shipped inside an installed package.
PACKAGED = "pkg://"


def package_file(path: str) -> Path:
    """The file at ``path`` (``~`` expanded, relative to the working directory), or at
    ``pkg://<package>/<file>``, wherever that package is installed. ``ModuleNotFoundError`` names
    a package that is not installed."""
    if not path.startswith(PACKAGED):
        return Path(path).expanduser()
    package, _, name = path.removeprefix(PACKAGED).partition("/")
    import importlib.resources

    return Path(str(importlib.resources.files(package) / name))


def current_umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only set it) where Linux allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(directory: Path) -> None:
    """Give ``directory`` and everything in it the modes ``mkdir()`` and ``open()`` would have.

    ``tempfile.mkdtemp`` and safetensors create theirs private; call this before publishing.
    """
    mask = current_umask()
    os.chmod(directory, 0o777 & ~mask)
    for parent, dirs, names in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o777 & ~mask)
        for name in names:
            os.chmod(os.path.join(parent, name), 0o666 & ~mask)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def owned(prefix: str) -> str:
    """``prefix`` and this process's mark, ``<pid>@<host>-``: the start of a temporary name that
    says who is writing it, so a later process can tell a leftover of killed work from work in
    progress (``abandoned``)."""
    return f"{prefix}{os.getpid()}@{_host()}-"


def abandoned(name: str, prefix: str) -> bool:
    """Whether ``name``, starting with ``prefix`` and marked by ``owned`` (anywhere after it: a
    step number may come first), belongs to no live process: written on this host by a process
    that is gone. A name without the mark, or from another host, whose process cannot be asked,
    is never called abandoned."""
    match = re.search(r"(?:^|-)(\d{1,10})@([^-/]+)-", name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None or match[2] != _host():
        return False
    try:
        os.kill(int(match[1]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive under another user; a pid no process can have
        return False
    return False


def remove_abandoned(directory: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Delete the entries of ``directory`` that ``abandoned`` calls leftovers; return those removed.
    Never fails: what cannot be listed or removed stays."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if any(abandoned(name, prefix) for prefix in prefixes):
            path = Path(directory) / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def _host() -> str:
    """This host's name as it may stand in a file name (no ``-``, which ends the mark)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"


def publish(tmp: Path, final: Path, attempts: int = 16) -> None:
    """Rename the directory ``tmp`` onto ``final``; an existing one is moved aside and deleted first.

    Concurrent writers of one target each retry until their rename lands; the last one wins,
    and every intermediate state is a complete directory or none.
    """
    apply_umask(tmp)
    for _ in range(attempts):
        try:
            os.rename(tmp, final)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        trash = final.with_name(f"{owned(f'.trash-{final.name}-')}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not replace {final}: other writers kept replacing it")


LOCK = ".skip.lock"
_MAX_HOLDER = 512  # what a holder writes of itself; a lock file is read no further
_held: dict[tuple[int, int], list] = {}  # (device, inode) of a lock file -> [descriptor, holds], this process's


class DirectoryInUse(SkipError):
    """Another live process writes this directory; the message names it and the way out."""


@contextmanager
def exclusive(directory: Path, what: str) -> Iterator[None]:
    """Hold ``directory``'s advisory lock (``flock`` on ``.skip.lock`` in it) for the block:
    a second process asking for it gets ``DirectoryInUse`` naming the holder (pid, host and
    ``what`` it is doing), while this process may take it again (two managers of one run). The
    kernel releases the lock when the holder dies, so a killed run never leaves it held."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise DirectoryInUse(
            f"{directory / LOCK} is a symbolic link; skip never locks through one: remove it"
        ) from None
    key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
    if key in _held:  # flock is per open file: this process's own second open would be refused
        os.close(fd)
        _held[key][1] += 1
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _MAX_HOLDER, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            from skip_core.console import printable

            raise DirectoryInUse(
                f"{directory} is in use by {printable(holder)}; wait for it to end, or give this run another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} ({what})".encode()[:_MAX_HOLDER], 0)
        _held[key] = [fd, 1]
    try:
        yield
    finally:
        _held[key][1] -= 1
        if not _held[key][1]:
            fd = _held.pop(key)[0]
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
