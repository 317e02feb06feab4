"""Entries this process has started writing: a lookup of one waits until it is settled.

A dump runs in the background after its call returned, so the next call may look up an entry
still being written; it waits for that write (and only for it), and sees this process's dumps
as if they had been written synchronously, as verl writes them. Keyed by (namespace directory,
step), so every store of a directory sees them.
"""

from __future__ import annotations

import threading
from pathlib import Path


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
        pending_writes.remove(self._key, self)
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


pending_writes = _PendingWrites()
