"""Durable file writes: complete or absent after a crash, with the modes the user's umask gives.

``tempfile`` creates private files (0600) and directories (0700) so that nobody else can
read a half-written one; renamed into place they would keep that mode, and a colleague
could not read a shared cache or checkpoint. Everything here is given the mode ``open()`` or
``mkdir()`` would have given it before it is published.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from skip_core.errors import SkipError
from skip_core.escaping import printable

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


def delete_tree(path: Path) -> None:
    """Delete a directory skip wrote (a link: itself only) and whatever is in it, as far as it can.
    Never follows a link, and never recurses: ``shutil.rmtree`` does, once per level, and a tree
    1,100 levels deep ends it in a ``RecursionError`` (which ``ignore_errors`` does not catch)."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    # The directories being emptied, each opened in its parent: descriptor, name, what stays in it.
    stack: list[tuple[int, str, set[str]]] = [(top, str(path), set())]
    while stack:
        here, _, kept = stack[-1]
        try:
            with os.scandir(here) as found:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found if e.name not in kept]
        except OSError:
            entries = []
        for name, is_dir in entries:
            if not is_dir:
                try:
                    os.unlink(name, dir_fd=here)
                except OSError:
                    kept.add(name)
        below = next((name for name, is_dir in entries if is_dir), None)
        if below is not None:
            try:
                stack.append((os.open(below, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=here), below, set()))
            except OSError:
                kept.add(below)
            continue
        os.close(here)
        _, name, _ = stack.pop()
        try:
            if stack:
                os.rmdir(name, dir_fd=stack[-1][0])
            else:
                os.rmdir(path)
        except OSError:
            if stack:
                stack[-1][2].add(name)


def remove_abandoned(
    directory: Path, prefixes: tuple[str, ...], delete: Callable[[Path], object] = delete_tree
) -> list[Path]:
    """Delete, with ``delete``, the entries of ``directory`` that ``abandoned`` calls leftovers;
    return those removed. Never fails: what cannot be listed or removed stays."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if any(abandoned(name, prefix) for prefix in prefixes):
            path = Path(directory) / name
            with contextlib.suppress(OSError):
                delete(path)
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def _host() -> str:
    """This host's name as it may stand in a file name (no ``-``, which ends the mark)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "_"


def publish(tmp: Path, final: Path, attempts: int = 16, delete: Callable[[Path], object] = delete_tree) -> None:
    """Rename the directory ``tmp`` onto ``final``; an existing one is moved aside and deleted
    first, with ``delete``.

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
        with contextlib.suppress(OSError):
            delete(trash)
    raise OSError(f"could not replace {final}: other writers kept replacing it")


LOCK = ".skip.lock"
_MAX_HOLDER = 512  # what a holder writes of itself; a lock file is read no further
_held: dict[Path, list] = {}  # directory -> [its lock file's descriptor, holds], this process's
_holding = threading.Lock()  # the threads of one process take and release ``_held`` one at a time


class DirectoryInUse(SkipError):
    """Another live process writes this directory; the message names it and the way out."""


@contextmanager
def exclusive(directory: Path, what: str) -> Iterator[None]:
    """Hold ``directory``'s advisory lock (``flock`` on ``.skip.lock`` in it) for the block:
    a second process asking for it gets ``DirectoryInUse`` naming the holder (pid, host and
    ``what`` it is doing), while this process may take it again (two managers of one run). The
    lock file goes with the last release; the kernel releases the lock of a holder that dies, so
    a killed run never leaves it held, only the file, which the next holder takes over."""
    directory = Path(directory).absolute()
    with _holding:
        if directory in _held:  # flock is per open file: this process's own second open would be refused
            _held[directory][1] += 1
        else:
            if not _held:  # a lock still held at exit (a manager never reset) goes with the process, file too
                atexit.register(_release_all)
            _held[directory] = [_take(directory, what), 1]
    try:
        yield
    finally:
        with _holding:
            if directory in _held:
                _held[directory][1] -= 1
                if not _held[directory][1]:
                    _release(directory)


def _release(directory: Path) -> None:
    fd = _held.pop(directory)[0]
    with contextlib.suppress(OSError):  # still locked: nobody else can be holding this very file
        os.unlink(directory / LOCK)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _release_all() -> None:
    with _holding:
        for directory in list(_held):
            _release(directory)


def _take(directory: Path, what: str) -> int:
    """A descriptor of ``directory``'s lock file, locked by this process and naming it."""
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise DirectoryInUse(
                f"{directory / LOCK} is a symbolic link; skip never locks through one: remove it"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a pipe planted there: no holder to read from it
            os.close(fd)
            raise DirectoryInUse(f"{directory / LOCK} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _MAX_HOLDER, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise DirectoryInUse(
                f"{directory} is in use by {printable(holder)}; wait for it to end, or give this run another directory"
            ) from None
        try:  # the file a releasing holder unlinked meanwhile is no lock: take the one now in its place
            if os.stat(directory / LOCK, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} ({what})".encode()[:_MAX_HOLDER], 0)
    return fd
