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
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

_now = time.time

# Attributes a span passes down to the spans opened inside it.
CONTEXT = ("step", "phase", "workid", "request_id", "offset", "turn")


class Span:
    """One timed event; sinks receive it when it ends.

    ``attrs`` are the keywords it was opened with plus what ``set`` added; those named in
    ``CONTEXT`` also hold for every span inside it, which ``context()`` resolves (off the hot
    path: opening a span only links it to its parent).
    """

    __slots__ = ("_context", "_id", "_token", "attrs", "end", "name", "parent", "start")

    def __init__(self, name: str, **attrs: Any) -> None:
        self.name, self.attrs, self.parent = name, attrs, _current.get()

    def set(self, **attrs: Any) -> None:
        """Add attributes known only once the work ran (tokens out, finish reason, cache hit)."""
        self.attrs.update(attrs)

    def __enter__(self) -> Span:
        self._token = _current.set(self)
        if _starters:
            for start in _starters:
                try:
                    start(self)
                except Exception as exc:
                    _switch_off(start, exc)
        self.start = _now()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = _now()
        _current.reset(self._token)
        _emit(self)

    @property
    def span_id(self) -> int:
        """Unique in this process; drawn when first read, by a sink, not when the span opens."""
        try:
            return self._id
        except AttributeError:
            with _id_lock:  # two sinks' threads may ask first at once: both must get one id
                if not hasattr(self, "_id"):
                    self._id = next(_ids)
            return self._id

    @property
    def parent_id(self) -> int:
        return 0 if self.parent is None else self.parent.span_id

    def context(self) -> dict[str, Any]:
        """The ``CONTEXT`` attributes in force for this span: its own over its ancestors'."""
        try:
            return self._context
        except AttributeError:
            inherited = {} if self.parent is None else self.parent.context()
            own = {key: self.attrs[key] for key in CONTEXT if key in self.attrs}
            self._context = {**inherited, **own} if own else inherited
            return self._context


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


_NO_SPAN = _NoSpan()
_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("skip_span", default=None)
_ids = itertools.count(1)
_id_lock = threading.Lock()
_switch_lock = threading.Lock()
_sinks: list[SpanSink] = []
_enders: list = []
_starters: list = []


def _no_span(name: str, **attrs: Any) -> _NoSpan:
    return _NO_SPAN


# ``span(name, **attrs)``: a context manager timing ``name``; attributes named in ``CONTEXT``
# are inherited by the spans inside it. It is ``Span`` itself while a sink listens and a
# function returning a shared no-op otherwise: rebinding the name saves a call per span, so
# call it as ``spans.span(...)``, never ``from skip_core.spans import span``.
span: Callable[..., Span | _NoSpan] = _no_span


def record(name: str, start: float, end: float, **attrs: Any) -> None:
    """Emit a span measured apart (a barrier wait known only once every worker is back)."""
    if not _enders:
        return
    done = Span(name, **attrs)
    done.start, done.end = start, end
    _emit(done)


def enabled() -> bool:
    return bool(_enders)


def _emit(done: Span) -> None:
    for end in _enders:
        try:
            end(done)
        except Exception as exc:  # a profiler must never fail the work it measures, nor starve other sinks
            _switch_off(end, exc)


def _switch_off(method: Any, exc: Exception) -> None:
    """Stop sending spans to the sink ``method`` belongs to, and say so once.

    The lists are replaced, not mutated, so a loop delivering the current span to the other
    sinks carries on undisturbed.
    """
    global _enders, _starters
    sink = _owner(method)
    with _switch_lock:
        if not any(_owner(fn) is sink for fn in (*_enders, *_starters)):
            return  # another thread switched it off first and has warned
        _enders = [fn for fn in _enders if _owner(fn) is not sink]
        _starters = [fn for fn in _starters if _owner(fn) is not sink]
        _rebind()
    warnings.warn(f"skip: span sink {sink!r} failed and is switched off: {exc!r}", RuntimeWarning, stacklevel=3)


def _owner(method: Any) -> Any:
    return getattr(method, "__self__", method)


def configure(sections: Any, worker: int) -> list[SpanSink]:
    """Ask the installed plugins for this process's sinks, given the run's validated
    ``skip_core.sections.Sections`` (``worker``: rollout rank, -1 driver)."""
    from skip_core.plugins import load_plugins

    close()
    sinks = [s for s in load_plugins().hook.skip_span_sinks(sections=sections, worker=worker) if s is not None]
    for sink in sinks:
        attach(sink)
    return sinks


def attach(sink: SpanSink) -> None:
    """Send every span of this process to ``sink`` from now on (``configure`` does it for plugins)."""
    _sinks.append(sink)
    _enders.append(sink.end)
    if callable(getattr(sink, "start", None)):
        _starters.append(sink.start)
    _rebind()


def _rebind() -> None:
    global span
    span = Span if _enders else _no_span


def flush() -> None:
    """Make every span ended so far durable (sinks write in the background otherwise)."""
    for sink in _sinks:
        _quietly(sink.flush)


def close() -> None:
    """Flush and detach every sink; spans are no-ops afterwards until ``configure``."""
    sinks = list(_sinks)
    _sinks.clear(), _enders.clear(), _starters.clear()
    _rebind()
    for sink in sinks:
        _quietly(sink.close)


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as exc:
        warnings.warn(f"skip: span sink {fn!r} failed: {exc!r}", RuntimeWarning, stacklevel=3)


atexit.register(close)
