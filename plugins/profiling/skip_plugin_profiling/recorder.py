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
import functools
import json
import os
import threading
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from skip_core import writing
from skip_core.spans import Span


class ProfilingWarning(UserWarning):
    """Profiling lost spans (a write failed); training goes on."""


_TOP_LEVEL = ("step", "phase", "workid")
_EXTRA = ("request_id", "offset", "turn")
_encode = json.JSONEncoder(default=str).encode  # one encoder: json.dumps(default=...) builds one per call


@functools.lru_cache(maxsize=4096)
def _quoted(name: str) -> str:
    """Event and phase names repeat: encode each once."""
    return _encode(name)


class _LocalClock:
    """ISO 8601 local time with microseconds, formatting the date and time once per second."""

    def __init__(self) -> None:
        self._second, self._prefix = -1, ""

    def iso(self, seconds: float) -> str:
        whole = int(seconds)
        if whole != self._second:
            self._second, self._prefix = whole, datetime.fromtimestamp(whole).isoformat()
        return f"{self._prefix}.{int((seconds - whole) * 1e6):06d}"


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
        self.end = self._queue.append  # the hot path: a C call, no Python frame
        self._files: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()  # one drain at a time: the thread, flush() and close()
        self._closed = threading.Event()
        self._failed = False
        self._pid = os.getpid()
        self._clock = _LocalClock()
        self._thread = threading.Thread(target=self._run, name="skip-profiling", daemon=True)
        self._thread.start()

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
        queue, steps = self._queue, self.steps
        while queue:
            span = queue.popleft()
            context = span.context()
            step, phase = context.get("step") or 0, context.get("phase") or "train"
            if not steps or step in steps:
                lines[(phase, step)].append(self._line(span, context, step, phase))
        for key, batch in lines.items():
            self._write(key, batch)

    def _line(self, span: Span, context: dict[str, Any], step: int, phase: str) -> str:
        """One JSON object, formatted by hand: only ``extra`` and the names need the JSON encoder."""
        extra = {**{k: v for k, v in context.items() if k in _EXTRA}, **span.attrs}
        for key in _TOP_LEVEL:
            extra.pop(key, None)
        workid = context.get("workid", self.worker)
        return (
            f'{{"timestamp": "{self._clock.iso(span.end)}", "event": {_quoted(span.name)}, '
            f'"duration_sec": {span.end - span.start!r}, "workid": {int(workid)}, "step": {int(step)}, '
            f'"phase": {_quoted(phase)}, "start": {span.start!r}, "pid": {self._pid}, "span_id": {span.span_id}, '
            f'"parent_id": {span.parent_id}, "extra": {_encode(extra)}}}\n'
        )

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
        folder = f"step_{step}" if phase == "train" else f"{phase}_step_{step}"
        # Unbuffered append: each flush is one write(2) per file, whole lines only, so a
        # reader (or a SIGKILL) never sees more than the last line cut short. No link followed.
        handle = writing.appending(self.directory, f"{folder}/worker_{self.worker}.jsonl")
        self._files[key] = handle
        return handle
