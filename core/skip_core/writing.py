"""Writing inside an output directory that someone else may have prepared: no link is ever
followed below it.

A profile, a cache or a run directory may arrive as a tarball, or be shared, and a link planted
at ``DIR/report`` or ``DIR/trace.json`` would turn a report into an overwrite of the user's own
files. Every write a command makes below its output root goes through here: each directory
between the root and the file is opened from its parent's descriptor with ``O_NOFOLLOW``
(``openat``), created there when missing, and a file is written to a temporary name in that
checked directory, fsynced, and renamed onto its name, which ``rename`` never resolves. A link or
anything else that is not a directory on the way, or a link or directory at the file's own
name, is refused in one line (``UnsafeDestination``). The root itself is the user's choice and
may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import IO

from skip_core.errors import SkipError
from skip_core.files import owned


class UnsafeDestination(SkipError, OSError):
    """A write refused: a link or a non-directory where skip would write; the message names it."""


def _parts(relative: str | os.PathLike) -> tuple[str, ...]:
    parts = PurePath(relative).parts
    if PurePath(relative).is_absolute() or any(part in ("..", ".") for part in parts):
        raise ValueError(f"{relative} is not a path inside the output directory")
    return parts


@contextlib.contextmanager
def directory(root: str | os.PathLike, relative: str | os.PathLike = "", create: bool = True) -> Iterator[int]:
    """A descriptor of ``root/relative``, every directory below ``root`` opened without following
    a link (created, with the umask's mode, when ``create``); ``UnsafeDestination`` naming the
    first that is a link or not a directory."""
    root = Path(root).expanduser()
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for part in _parts(relative):
            where = where / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(where, fd, part) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _refused(path: Path, parent: int, name: str) -> UnsafeDestination:
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        mode = 0
    what = (
        "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
        else "a file" if stat.S_ISREG(mode) else "not a regular file"
    )  # fmt: skip
    return UnsafeDestination(
        f"{path} is {what}; skip never writes through a link or over what it did not write: "
        "remove it or choose another output directory"
    )


@contextlib.contextmanager
def opened(root: str | os.PathLike, relative: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A file to write as ``root/relative``: a temporary one in the checked directory, fsynced and
    renamed onto its name if the block succeeds, removed if it fails. ``mode``: ``"wb"`` or ``"w"``
    (UTF-8 text)."""
    *parents, name = _parts(relative)
    with directory(root, PurePath(*parents) if parents else "") as fd:
        where = Path(root).expanduser().joinpath(*parents, name)
        _check_target(where, fd, name)
        tmp = f"{owned(f'.{name}.')}{uuid.uuid4().hex[:12]}.tmp"
        # 0o666 and O_CREAT: the umask's mode, as open() gives; O_EXCL and O_NOFOLLOW: our own new file.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        text = {} if "b" in mode else {"encoding": "utf-8"}
        handle = os.fdopen(os.open(tmp, flags, 0o666, dir_fd=fd), mode, **text)
        try:
            with handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            _check_target(where, fd, name)  # a link planted meanwhile: rename would replace it, not follow it
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise


def appending(root: str | os.PathLike, relative: str | os.PathLike) -> IO[bytes]:
    """``root/relative`` opened to append to, unbuffered (a log): created with the umask's mode
    when missing; a link at its name or on the way, or anything but a regular file, is refused."""
    *parents, name = _parts(relative)
    with directory(root, PurePath(*parents) if parents else "") as parent:
        where = Path(root).expanduser().joinpath(*parents, name)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o666, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # ENXIO: a named pipe no one reads
                raise _refused(where, parent, name) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _refused(where, parent, name)
        os.set_blocking(fd, True)
    return os.fdopen(fd, "ab", buffering=0)


def _check_target(where: Path, parent: int, name: str) -> None:
    """Refuse to replace a link (the user meant its target) or a directory at the file's name; a
    named pipe or a socket there holds nothing, and is replaced."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
        raise _refused(where, parent, name)


def write_bytes(root: str | os.PathLike, relative: str | os.PathLike, data: bytes) -> Path:
    """Replace ``root/relative`` with ``data`` atomically (see ``opened``); returns its path."""
    with opened(root, relative) as handle:
        handle.write(data)
    return Path(root).expanduser() / relative


def write_text(root: str | os.PathLike, relative: str | os.PathLike, text: str) -> Path:
    """``write_bytes`` of ``text`` in UTF-8."""
    return write_bytes(root, relative, text.encode("utf-8"))


def makedirs(root: str | os.PathLike, relative: str | os.PathLike = "") -> Path:
    """Create ``root/relative`` (see ``directory``); returns its path."""
    with directory(root, relative):
        pass
    return Path(root).expanduser() / relative
