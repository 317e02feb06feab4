"""The on-disk cache of step results: atomic, verified on read, confined to its directory.

Layout (verl's for role ``rollout``, so verl configs work unchanged; any other role adds a
``{role}/`` level after the run name)::

    {dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt}_out{response}/{step}/
        meta.json              format version, role, step, namespace, input fingerprint,
                               and the size and xxh3-128 hash of every data file
        tensors.safetensors    Batch.batch
        data.json              Batch.non_tensor_batch and meta_info
    .../GBS.../generation_{k}/{step}/   the k-th extra generation of a step (DAPO), same files

A step directory is written beside its final place (``.tmp-*``), fsynced, and renamed into
place, so it is complete or absent. Readers verify it before use; anything wrong is a
warning and a miss, never an exception in the training step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import mmap
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from skip_core import encoding
from skip_core.config import Namespace
from skip_core.files import fsync_dir, publish, write_synced

FORMAT = "skip-cache"
VERSION = 1
META = "meta.json"
DATA_FILES = frozenset({encoding.TENSORS, encoding.DATA})
MAX_META_BYTES = 1 << 20
SHAPE_PATTERN = re.compile(r"GBS\d+_N\d+_in\d+_out\d+")
LEFTOVER_PREFIXES = (".tmp-", ".trash-")


class CacheWarning(UserWarning):
    """A cache entry was ignored (corrupt, truncated, foreign) or a dump failed."""


class CorruptEntry(Exception):
    """A step directory that must not be loaded; the message says why."""


@dataclass(frozen=True)
class Entry:
    """A verified step directory."""

    step: int
    path: Path
    meta: dict

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("fingerprint")


def safe_name(text: str) -> str:
    """One path component made from config text: no separators, no leading dots."""
    name = re.sub(r"[^A-Za-z0-9._=+-]", "_", text)[:200]
    return re.sub(r"^\.+", lambda m: "_" * len(m.group()), name) or "_"


class PendingWrite:
    """An entry this process has started writing; lookups of it wait until it is settled."""

    __slots__ = ("_done", "_key", "ok")

    def __init__(self, key: tuple[Path, int]) -> None:
        self._key = key
        self._done = threading.Event()
        self.ok = False

    def settle(self, ok: bool) -> None:
        """Record the outcome and release the waiting lookups; call exactly once."""
        self.ok = ok
        _pending.remove(self._key, self)
        self._done.set()

    def wait(self) -> bool:
        self._done.wait()
        return self.ok


class _PendingWrites:
    """Process-wide, keyed by (namespace directory, step): every store of a directory sees them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: dict[tuple[Path, int], list[PendingWrite]] = {}

    def add(self, key: tuple[Path, int]) -> PendingWrite:
        write = PendingWrite(key)
        with self._lock:
            self._writes.setdefault(key, []).append(write)
        return write

    def remove(self, key: tuple[Path, int], write: PendingWrite) -> None:
        with self._lock:
            writes = self._writes.get(key, [])
            if write in writes:
                writes.remove(write)
            if not writes:
                self._writes.pop(key, None)

    def wait(self, key: tuple[Path, int]) -> bool | None:
        """Wait for the writes of ``key`` started so far: ``None`` if there were none, else the newest's outcome."""
        with self._lock:
            writes = list(self._writes.get(key, ()))
        outcomes = [write.wait() for write in writes]
        return outcomes[-1] if outcomes else None

    def steps(self, directory: Path) -> set[int]:
        with self._lock:
            return {step for where, step in self._writes if where == directory}


_pending = _PendingWrites()


class CacheStore:
    """The step directories of one role in one run namespace.

    A dump runs in the background after its call returned, so the next call may look up an
    entry that is still being written. ``expect(step)`` announces such a write before it
    starts; lookups of that entry then wait for it (and only for it), so this process sees
    its own dumps exactly as if they had been written synchronously, as verl writes them.
    """

    def __init__(self, root: str | os.PathLike, namespace: Namespace, role: str) -> None:
        self.root = Path(root).expanduser().absolute()
        self.namespace = namespace
        self.role = role
        run = self.root / safe_name(f"{namespace.experiment_name}_{namespace.project_name}")
        # ``rollout`` keeps verl's layout; other roles nest under their name, so roles sharing
        # a dump_dir never share a step directory.
        self.directory = (run if role == "rollout" else run / safe_name(role)) / namespace.shape

    def path(self, step: int) -> Path:
        return self.directory / str(int(step))

    def generation(self, index: int) -> CacheStore:
        """The store of the ``index``-th generation of each step (``SkipManager.generation_scope``):
        the first keeps verl's layout; the others nest in ``generation_<index>/`` beside the steps."""
        if index == 0:
            return self
        other = copy.copy(self)
        other.directory = self.directory / f"generation_{int(index)}"
        return other

    def check_writable(self) -> None:
        """Create the namespace directory and prove a file can be written there."""
        self._makedirs()
        with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".tmp-probe-"):
            pass

    def expect(self, step: int) -> PendingWrite:
        """Announce that this process is writing the entry of ``step``; settle the result when done."""
        return _pending.add((self.directory, int(step)))

    def steps(self) -> list[int]:
        """Steps that have a directory, valid or not, or a write of this process under way."""
        pending = _pending.steps(self.directory)
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        except OSError as exc:
            warnings.warn(f"skip: cannot list cache directory {self.directory}: {exc}", CacheWarning, stacklevel=2)
            names = []
        return sorted(pending.union(int(n) for n in names if n.isdigit()))

    def entry(self, step: int) -> Entry | None:
        """The verified entry of ``step``; a warning and ``None`` if it is present but bad.

        A write of this entry under way in this process is waited for; if it failed, this is a miss.
        """
        if _pending.wait((self.directory, int(step))) is False:
            return None
        path = self.path(step)
        if not path.exists():
            return None
        try:
            meta = verify(path, role=self.role, namespace=self.namespace)
        except CorruptEntry as exc:
            warnings.warn(f"skip: ignoring cache entry {path}: {exc}", CacheWarning, stacklevel=2)
            return None
        return Entry(step, path, meta)

    def nearest(self, step: int) -> Entry | None:
        """The entry ``repeat`` uses: this step, else the largest below, else the smallest above."""
        present = self.steps()
        below = sorted((s for s in present if s < step), reverse=True)
        above = sorted(s for s in present if s > step)
        for candidate in [step, *below, *above]:
            found = self.entry(candidate)
            if found is not None:
                return found
        return None

    def load(self, entry: Entry) -> Any:
        return encoding.read(entry.path)

    def save(self, step: int, batch: Any, fingerprint: str | None = None) -> Path:
        """Write ``batch`` as the entry of ``step``, replacing any previous one, atomically."""
        self._makedirs()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{step}-", dir=self.directory))
        try:
            names = encoding.write(batch, tmp)
            files = {name: seal(tmp / name) for name in names}
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "role": self.role,
                "step": int(step),
                "namespace": dataclasses.asdict(self.namespace),
                "fingerprint": fingerprint,
                "samples": len(batch),
                "files": files,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "writer": {"host": socket.gethostname(), "pid": os.getpid()},
            }
            write_synced(tmp / META, json.dumps(meta, indent=1).encode())
            fsync_dir(tmp)
            final = self.path(step)
            if foreign := foreign_files(final):  # replacing deletes: never what skip did not write
                raise FileExistsError(f"{final} holds files skip did not write ({', '.join(foreign)}); left as it is")
            publish(tmp, final)
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _makedirs(self) -> None:
        """Create the namespace directories one by one, never following a link out of the root."""
        self.root.mkdir(parents=True, exist_ok=True)
        root = self.root.resolve()
        current = self.root
        for part in self.directory.relative_to(self.root).parts:
            current = current / part
            if not current.resolve().is_relative_to(root):
                raise PermissionError(f"{current} resolves outside the dump directory {root}; refusing to write")
            current.mkdir(exist_ok=True)


def foreign_files(path: Path) -> list[str]:
    """Files of a step directory that skip does not write (a verl dump's ``gen_batch.dp``)."""
    try:  # another writer may be replacing it right now
        return sorted(set(os.listdir(path)) - DATA_FILES - {META})
    except (FileNotFoundError, NotADirectoryError):
        return []


def verify(path: Path, role: str | None = None, namespace: Namespace | None = None, deep: bool = True) -> dict:
    """Check one step directory against its ``meta.json``; return the meta or raise ``CorruptEntry``.

    ``deep=False`` checks sizes only (for listings); loading always checks hashes too.
    """
    meta = _read_meta(path / META)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        if other := foreign_files(path):
            raise CorruptEntry(f"not a skip entry: holds {', '.join(other)}")
        raise CorruptEntry(f"unsupported format {meta.get('format')!r} version {meta.get('version')!r}")
    if str(meta.get("step")) != path.name:
        raise CorruptEntry(f"meta.json records step {meta.get('step')!r} in directory {path.name!r}")
    if role is not None and meta.get("role") != role:
        raise CorruptEntry(f"written for role {meta.get('role')!r}, not {role!r}")
    if namespace is not None and meta.get("namespace") != dataclasses.asdict(namespace):
        raise CorruptEntry(f"written by another run: namespace {meta.get('namespace')!r}")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != DATA_FILES:
        raise CorruptEntry(f"meta.json lists files {sorted(files) if isinstance(files, dict) else files!r}")
    for name, expected in files.items():
        _check_file(path / name, expected, deep)
    return meta


def _read_meta(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_META_BYTES + 1)
    except FileNotFoundError:
        raise CorruptEntry("incomplete: meta.json is missing") from None
    except OSError as exc:
        raise CorruptEntry(f"cannot read meta.json: {exc}") from None
    if len(raw) > MAX_META_BYTES:
        raise CorruptEntry("meta.json is too large")
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise CorruptEntry(f"meta.json is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CorruptEntry("meta.json is not an object")
    return meta


def _check_file(path: Path, expected: Any, deep: bool) -> None:
    if not isinstance(expected, dict):
        raise CorruptEntry(f"meta.json entry for {path.name} is malformed")
    try:
        size = path.stat().st_size
        if size != expected.get("bytes"):
            raise CorruptEntry(f"{path.name} has {size} bytes, meta.json records {expected.get('bytes')}")
        if deep and file_digest(path) != expected.get("xxh3_128"):
            raise CorruptEntry(f"{path.name} does not match its recorded hash")
    except OSError as exc:
        raise CorruptEntry(f"cannot read {path.name}: {exc}") from None


def file_digest(path: Path) -> str:
    """xxh3-128 of a file, read through a memory map (no copy into Python)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
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
    """Every step directory under ``root`` (a dump_dir or any directory inside one)."""
    root = Path(root)
    if root.name.isdigit() and SHAPE_PATTERN.fullmatch(root.parent.name):
        yield root
        return
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort(key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n))
        if SHAPE_PATTERN.fullmatch(os.path.basename(dirpath)):
            for name in dirnames:
                if name.isdigit():
                    yield Path(dirpath) / name
            dirnames[:] = []


def leftovers(root: Path) -> Iterator[Path]:
    """Temporary and trash directories left by interrupted dumps under ``root``."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in list(dirnames):
            if name.startswith(LEFTOVER_PREFIXES):
                dirnames.remove(name)
                yield Path(dirpath) / name
