"""Reading files that may be hostile: a cache or a checkpoint someone sent you, a log.

Caches travel as tarballs, which keep named pipes, device nodes and symbolic links. Every
file read here is opened without following a link, must be a regular file (a pipe would block
forever, ``/dev/zero`` never ends), must lie inside the directory it belongs to, and is refused
if larger than its reader allows before a byte is read. JSON is bounded in size and in
nesting, which ``json`` and every recursive walk of its result would otherwise turn into a
``RecursionError`` far from the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

#: Nesting that no JSON skip writes comes near (a batch's messages: about 12 levels).
MAX_DEPTH = 100
#: What parsing JSON may cost in memory, per byte of text, and in any case. Measured on CPython
#: 3.11 (tracemalloc): a batch's chat messages cost 6.5 bytes of objects per byte, floats 6.6,
#: distinct short strings about 11; ``[[],[],...]`` costs 22 (a list per 3 bytes) and 64 MiB of it
#: took 3.3 GB. ``json_cost`` estimates it before parsing, and more is refused.
JSON_AMPLIFICATION = 16
JSON_FLOOR = 16 << 20
_CONTAINER_BYTES = 72  # a list or dict's header and its parent's pointer, beyond the text's bytes
_BRACKETS = np.zeros(256, np.int8)  # +1 opens a level, -1 closes one
_BRACKETS[list(b"[{")], _BRACKETS[list(b"]}")] = 1, -1


class UnsafeFile(ValueError):
    """A file that must not be read; the message says which and why."""


@contextlib.contextmanager
def opened(path: str | os.PathLike, limit: int | None = None, root: str | os.PathLike | None = None) -> Iterator[int]:
    """A read-only descriptor of the regular file ``path``: not a link, inside ``root`` (when
    given, after resolving every link above it), at most ``limit`` bytes. ``UnsafeFile`` otherwise;
    ``FileNotFoundError`` and other ``OSError`` pass through."""
    path = Path(path)
    if root is not None and not _inside(path.parent).startswith(_inside(root)):
        raise UnsafeFile(f"{path.name} lies outside {root} (through a symbolic link)")
    try:  # O_NONBLOCK: opening a pipe with no writer returns at once instead of waiting for one
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{path.name} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path.name} is not a regular file ({_kind(info.st_mode)})")
        if limit is not None and info.st_size > limit:
            raise UnsafeFile(f"{path.name} has {info.st_size} bytes, more than the {limit} allowed")
        yield fd
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike, limit: int, root: str | os.PathLike | None = None) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (see ``opened``)."""
    with opened(path, limit, root) as fd, os.fdopen(os.dup(fd), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since it was checked
        raise UnsafeFile(f"{Path(path).name} has more than the {limit} bytes allowed")
    return data


def read_json(
    path: str | os.PathLike, limit: int, root: str | os.PathLike | None = None, depth: int = MAX_DEPTH
) -> Any:
    """A JSON file of at most ``limit`` bytes and ``depth`` levels of nesting; ``UnsafeFile`` for
    anything else, naming the file."""
    data = read_bytes(path, limit, root)
    try:
        return loads(data, depth)
    except json.JSONDecodeError as exc:
        raise UnsafeFile(f"{Path(path).name} is not valid JSON: {exc}") from None
    except ValueError as exc:  # too deep, too costly, an integer of too many digits
        raise UnsafeFile(f"{Path(path).name}: {exc}") from None


def loads(data: bytes | str, depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` of a document nested at most ``depth`` levels, whose objects would cost no
    more than ``JSON_AMPLIFICATION`` times its size (``json_cost``); ``ValueError`` otherwise
    (deeper nesting, too many containers, invalid JSON, an integer of more digits than Python converts)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    containers = raw.count(b"[") + raw.count(b"{")
    # First, as the nesting scan costs some 30 bytes a bracket.
    if (cost := json_cost(len(raw), containers)) > max(JSON_AMPLIFICATION * len(raw), JSON_FLOOR):
        raise ValueError(
            f"its {containers} lists and objects in {len(raw)} bytes would take about {cost >> 20} MiB to read, "
            f"more than {JSON_AMPLIFICATION} times its size"
        )
    # No more opening brackets than levels allowed: no deeper either, and no scan needed.
    if containers > depth and (deepest := nesting(raw)) > depth:
        raise ValueError(f"nested {deepest} levels deep, more than the {depth} skip reads")
    return json.loads(raw)


def json_cost(size: int, containers: int) -> int:
    """An upper estimate, in bytes, of the objects ``json.loads`` builds from ``size`` bytes of
    text holding ``containers`` lists and objects."""
    return 8 * size + _CONTAINER_BYTES * containers


def nesting(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest, those inside strings aside: linear, vectorized,
    never recursive."""
    codes = np.frombuffer(raw, np.uint8)
    quotes = np.flatnonzero(codes == ord('"'))
    # A quote after an odd run of backslashes belongs to a string: drop it from the delimiters.
    slashes = np.flatnonzero(codes == ord("\\"))
    if len(slashes):
        starts = slashes[np.r_[True, np.diff(slashes) > 1]]
        ends = slashes[np.r_[np.diff(slashes) > 1, True]]
        after = ends + 1
        odd = ((ends - starts) % 2 == 0) & (after < len(codes))
        escaped = after[odd][codes[after[odd]] == ord('"')]
        quotes = quotes[~np.isin(quotes, escaped, assume_unique=True)]
    brackets = np.flatnonzero(_BRACKETS[codes])
    outside = np.searchsorted(quotes, brackets) % 2 == 0  # an even number of quotes before it
    steps = _BRACKETS[codes[brackets[outside]]].astype(np.int64)
    return int(np.cumsum(steps).max()) if len(steps) else 0


def walk(root: str | os.PathLike) -> Iterator[tuple[Path, list[str], list[str]]]:
    """``os.walk(root)`` top-down, links never followed, without recursion: Python 3.11's
    ``os.walk`` (and ``Path.rglob``, ``shutil.rmtree``) recurse once per level, and a tree
    1,100 directories deep, which anyone can make, ends in a ``RecursionError``. The caller may
    prune ``dirnames`` in place, as with ``os.walk``; what cannot be listed is skipped."""
    stack = [Path(root)]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as found:
                entries = list(found)
        except OSError:
            continue
        dirnames = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        filenames = sorted(e.name for e in entries if not e.is_dir(follow_symlinks=False))
        yield here, dirnames, filenames
        stack.extend(here / name for name in reversed(dirnames))


def _inside(root: str | os.PathLike) -> str:
    real = os.path.realpath(root)
    return real if real.endswith(os.sep) else real + os.sep


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a plain file")
