"""Spans: named, timed, nested events of a run, delivered to whatever sinks plugins provide.

Core opens spans around the work that explains where a step's time goes: each request, turn,
engine call and tool call of the agent loop, barrier waits and batch construction on the
driver, weight sync, skip cache lookups, loads and dumps, and the trainer's phases. A
profiling plugin returns a sink from ``skip_span_sinks``; with none, ``span()`` hands back one
shared no-op object, so instrumented code costs a function call.

A span inherits the request context of the span it runs in (``step``, ``phase``, ``workid``,
``request_id``, ``offset``, ``turn``) through a context variable, so asyncio tasks and
threads started with a copied context (``asyncio.to_thread``, ``contextvars.copy_context``)
nest correctly without passing anything around. Times are ``time.time()`` seconds: spans of
different processes land on one clock.
"""

from __future__ import annotations

import atexit
import contextvars
import itertools
import time
import warnings
from typing import Any, Protocol


class Span:
    """One timed event; sinks read its fields when it ends (``end`` is set then)."""

    __slots__ = (
        "_token",
        "attrs",
        "end",
        "name",
        "offset",
        "parent_id",
        "phase",
        "request_id",
        "span_id",
        "start",
        "step",
        "turn",
        "workid",
    )

    def __init__(self, name: str, parent: Span, context: tuple, attrs: dict[str, Any]) -> None:
        self.name, self.attrs = name, attrs
        self.span_id, self.parent_id = next(_ids), parent.span_id
        step, phase, workid, request_id, offset, turn = context
        self.step = parent.step if step is None else step
        self.phase = parent.phase if phase is None else phase
        self.workid = parent.workid if workid is None else workid
        self.request_id = parent.request_id if request_id is None else request_id
        self.offset = parent.offset if offset is None else offset
        self.turn = parent.turn if turn is None else turn
        self.start = self.end = 0.0
        self._token = None

    def set(self, **attrs: Any) -> None:
        """Add attributes known only once the work ran (tokens out, finish reason, cache hit)."""
        self.attrs.update(attrs)

    def __enter__(self) -> Span:
        self._token = _current.set(self)
        self.start = time.time()
        for start in _starters:
            start(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = time.time()
        _current.reset(self._token)
        _emit(self)


class _Root(Span):
    """The context outside any span: no parent, nothing inherited."""

    def __init__(self) -> None:
        self.name, self.attrs, self.span_id, self.parent_id = "", {}, 0, 0
        self.step = self.phase = self.workid = self.request_id = self.offset = self.turn = None


class _NoSpan:
    """What ``span()`` returns while nothing listens: every operation does nothing."""

    __slots__ = ()

    def set(self, **attrs: Any) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class SpanSink(Protocol):
    """What a profiler returns from ``skip_span_sinks``. ``end`` runs on the hot path: append
    the span somewhere and return; an optional ``start(span)`` is called as a span opens."""

    def end(self, span: Span) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


_ROOT = _Root()
_NO_SPAN = _NoSpan()
_current: contextvars.ContextVar[Span] = contextvars.ContextVar("skip_span", default=_ROOT)
_ids = itertools.count(1)
_sinks: list[SpanSink] = []
_enders: list = []
_starters: list = []


def span(
    name: str,
    *,
    step: int | None = None,
    phase: str | None = None,
    workid: int | None = None,
    request_id: str | None = None,
    offset: int | None = None,
    turn: int | None = None,
    **attrs: Any,
) -> Span | _NoSpan:
    """A context manager timing ``name``; the keyword-only context fields are inherited by the
    spans opened inside it, other keywords are this span's attributes."""
    if not _enders:
        return _NO_SPAN
    return Span(name, _current.get(), (step, phase, workid, request_id, offset, turn), attrs)


def record(
    name: str,
    start: float,
    end: float,
    *,
    step: int | None = None,
    phase: str | None = None,
    workid: int | None = None,
    request_id: str | None = None,
    offset: int | None = None,
    turn: int | None = None,
    **attrs: Any,
) -> None:
    """Emit a span measured apart (a barrier wait known only once every worker is back)."""
    if not _enders:
        return
    done = Span(name, _current.get(), (step, phase, workid, request_id, offset, turn), attrs)
    done.start, done.end = start, end
    _emit(done)


def enabled() -> bool:
    return bool(_enders)


def _emit(done: Span) -> None:
    for end in _enders:
        try:
            end(done)
        except Exception as exc:  # a profiler must never fail the work it measures
            _drop(end, exc)


def _drop(end: Any, exc: Exception) -> None:
    warnings.warn(f"skip: span sink {end!r} failed and is switched off: {exc!r}", RuntimeWarning, stacklevel=3)
    if end in _enders:
        _enders.remove(end)


def configure(config: Any, worker: int) -> list[SpanSink]:
    """Ask the installed plugins for this process's sinks (``worker``: rollout rank, -1 driver)."""
    from skip_core.config import ConfigError, select
    from skip_core.plugins import load_plugins

    close()
    sinks = [s for s in load_plugins().hook.skip_span_sinks(config=config, worker=worker) if s is not None]
    if not sinks and select(config, "profiling.enable") is True:
        raise ConfigError(
            "profiling.enable is true but no installed plugin records spans: pip install skip-plugin-profiling"
        )
    _sinks.extend(sinks)
    _enders.extend(s.end for s in sinks)
    _starters.extend(s.start for s in sinks if callable(getattr(s, "start", None)))
    return sinks


def flush() -> None:
    """Make every span ended so far durable (sinks write in the background otherwise)."""
    for sink in _sinks:
        _quietly(sink.flush)


def close() -> None:
    """Flush and detach every sink; spans are no-ops afterwards until ``configure``."""
    sinks = list(_sinks)
    _sinks.clear(), _enders.clear(), _starters.clear()
    for sink in sinks:
        _quietly(sink.close)


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as exc:
        warnings.warn(f"skip: span sink {fn!r} failed: {exc!r}", RuntimeWarning, stacklevel=3)


atexit.register(close)
