"""Durable file writes: complete or absent after a crash, with the modes the user's umask gives.

``tempfile`` creates private files (0600) and directories (0700) so that nobody else can
read a half-written one; renamed into place they would keep that mode, and a colleague
could not read a shared cache or checkpoint. Everything here is given the mode ``open()`` or
``mkdir()`` would have given it before it is published.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; fsynced and renamed onto ``path`` if the block succeeds."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a crash leaves the old file or the new one, never half."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


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
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not replace {final}: other writers kept replacing it")
