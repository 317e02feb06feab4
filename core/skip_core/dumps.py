"""The cache's dumps in the background: a decorated call returns as soon as its result exists,
and its entry is written by one of two threads meanwhile. A failed dump is a warning and a miss
for whoever waits on it, never a failed step; ``Dumps.flush`` waits for every dump started so far.
"""

from __future__ import annotations

import atexit
import contextvars
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from skip_core import spans
from skip_core.pending import PendingWrite
from skip_core.store import CacheWarning


class Dumps:
    """Background dumps: a failure is a warning; ``flush`` waits for all started so far."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, role: str, step: int, path: Path, work: Callable[[], Any], write: PendingWrite) -> None:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="skip-dump")
                atexit.register(self.flush)
            # In the caller's context, so the dump's span lands in the step that produced it.
            try:
                future = self._executor.submit(contextvars.copy_context().run, dump, role, step, path, work, write)
            except RuntimeError as exc:  # the interpreter is shutting down
                write.settle(False)
                warnings.warn(f"skip.{role} step {step}: dump not started: {exc!r}", CacheWarning, stacklevel=3)
                return
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def flush(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)


def dump(role: str, step: int, path: Path, work: Callable[[], Any], write: PendingWrite) -> None:
    """Run one dump; a failure is a warning naming the entry (a full disk's error names no file),
    and a miss for the lookups waiting on ``write``."""
    ok = False
    try:
        with spans.span("skip_dump", role=role):
            work()
        ok = True
    except Exception as exc:
        what = f"skip.{role} step {step}: dump failed, training continues: {exc!r}"
        warnings.warn(f"{what} (writing {path})", CacheWarning, stacklevel=1)
    finally:
        write.settle(ok)
