"""The span sink: ended spans go into a queue on the hot path and into JSONL files off it.

``end`` only appends the span to a ``collections.deque`` (thread-safe, no lock) after a step
filter, so an instrumented event costs well under a microsecond. A daemon thread wakes every
``flush_interval_s``, turns the queued spans into lines and appends them with one write per
file. A SIGKILL therefore loses at most the spans of the last interval; a normal exit or an
exception loses none, because ``close`` (called by ``skip_core.spans.close`` and at exit)
drains the queue. A failed write warns once and drops spans: profiling never stops training.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from skip_core.spans import Span


class ProfilingWarning(UserWarning):
    """Profiling lost spans (a write failed); training goes on."""


class Recorder:
    """One process's sink: files ``{dir}/step_{k}/worker_{worker}.jsonl`` (``val_step_{k}`` for validation)."""

    def __init__(
        self, directory: str | os.PathLike, worker: int, steps: Iterable[int] = (), flush_interval_s: float = 1.0
    ):
        self.directory = Path(directory)
        self.worker = worker
        self.steps = frozenset(steps)
        self.flush_interval_s = flush_interval_s
        self.written = 0
        self.dropped = 0
        self._queue: collections.deque[Span] = collections.deque()
        self._files: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()  # one drain at a time: the thread, flush() and close()
        self._closed = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="skip-profiling", daemon=True)
        self._thread.start()

    def end(self, span: Span) -> None:
        if self.steps and span.step not in self.steps:
            return
        self._queue.append(span)

    def flush(self) -> None:
        with self._lock:
            self._drain()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join()
        with self._lock:
            self._drain()
            for handle in self._files.values():
                handle.close()
            self._files.clear()

    def _run(self) -> None:
        while not self._closed.wait(self.flush_interval_s):
            self.flush()

    def _drain(self) -> None:
        lines: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
        queue, pid = self._queue, os.getpid()
        while queue:
            span = queue.popleft()
            phase = span.phase or "train"
            lines[(phase, span.step or 0)].append(self._line(span, phase, pid))
        for key, batch in lines.items():
            self._write(key, batch)

    def _line(self, span: Span, phase: str, pid: int) -> str:
        extra = dict(span.attrs)
        for name in ("request_id", "offset", "turn"):
            value = getattr(span, name)
            if value is not None:
                extra[name] = value
        entry = {
            "timestamp": datetime.fromtimestamp(span.end).isoformat(),
            "event": span.name,
            "duration_sec": span.end - span.start,
            "workid": self.worker if span.workid is None else span.workid,
            "step": span.step or 0,
            "phase": phase,
            "start": span.start,
            "pid": pid,
            "span_id": span.span_id,
            "parent_id": span.parent_id,
            "extra": extra,
        }
        return json.dumps(entry, default=str) + "\n"

    def _write(self, key: tuple[str, int], lines: list[str]) -> None:
        if self._failed:
            self.dropped += len(lines)
            return
        try:
            handle = self._files.get(key) or self._open(key)
            data = memoryview("".join(lines).encode())
            while data:
                data = data[handle.write(data) :]
            self.written += len(lines)
        except OSError as exc:
            self._failed = True
            self.dropped += len(lines)
            warnings.warn(
                f"skip profiling: writing spans under {self.directory} failed ({exc!r}); "
                "profiling stops, training goes on",
                ProfilingWarning,
                stacklevel=2,
            )

    def _open(self, key: tuple[str, int]) -> Any:
        phase, step = key
        folder = self.directory / (f"step_{step}" if phase == "train" else f"{phase}_step_{step}")
        folder.mkdir(parents=True, exist_ok=True)
        # Unbuffered append: each flush is one write(2) per file, whole lines only, so a
        # reader (or a SIGKILL) never sees more than the last line cut short.
        handle = open(folder / f"worker_{self.worker}.jsonl", "ab", buffering=0)  # noqa: SIM115
        self._files[key] = handle
        return handle
