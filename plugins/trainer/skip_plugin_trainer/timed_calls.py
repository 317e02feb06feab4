"""Calls into a user's code that the trainer stops waiting for: ``TimedCalls`` runs each call on a
daemon thread and gives up on it after ``timeout_s``.

A thread rather than a process: the call runs in the trainer's process as verl runs a reward
function, with nothing pickled (not the function, its arguments or its module) and no process
started per call, which would cost more than most reward functions take; and forking a driver
that holds Ray's and torch's threads is unsafe. What a thread cannot do is stop the call: Python
cannot kill a thread. A call past its deadline keeps its thread, which ends when the call returns
or with the process (a daemon thread never holds up the exit), and the next call gets a fresh
thread. ``max_hung`` bounds how many such threads may be running at once: past it ``call``
raises ``TooManyHung``, so a function that hangs on every call stops the run instead of piling up
threads. A call stuck in C code that holds the GIL (a catastrophic regular expression) stalls
the waiting thread as well; only a process could bound that.

Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class TooManyHung(RuntimeError):
    """``running`` calls given up on are still running: one more thread is refused."""

    def __init__(self, running: int) -> None:
        super().__init__(f"{running} calls past their deadline are still running")
        self.running = running


@dataclass
class Outcome:
    """How a call ended: its ``value``, the exception it raised (``error``), or neither by its
    deadline (``timed_out``)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class _Worker:
    """A daemon thread running the calls put on its queue, one after another, until it gets ``None``."""

    def __init__(self, name: str) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.calls.get()) is not None:
            fn, args, outcome, done = job
            try:
                outcome.value = fn(*args)
            except BaseException as exc:  # the user's code: what it raises is the caller's to report
                outcome.error = exc
            done.set()


class TimedCalls:
    """``call(fn, *args)`` waits at most ``timeout_s`` for ``fn(*args)``; at most ``max_hung`` calls
    given up on may still be running when another call starts. ``close`` ends the idle thread."""

    def __init__(self, timeout_s: float, max_hung: int, name: str = "skip-timed-call") -> None:
        self.timeout_s, self.max_hung, self.name = timeout_s, max_hung, name
        self._wait = min(timeout_s, threading.TIMEOUT_MAX)  # a longer wait (inf) is an OverflowError
        self._worker: _Worker | None = None
        self._hung: list[threading.Thread] = []

    @property
    def hung(self) -> int:
        """How many calls given up on are still running."""
        self._hung = [thread for thread in self._hung if thread.is_alive()]
        return len(self._hung)

    def call(self, fn: Callable[..., Any], *args: Any) -> Outcome:
        """``fn(*args)`` on the worker thread: what it returned or raised, or ``timed_out``."""
        running = self.hung
        if running >= self.max_hung:
            raise TooManyHung(running)
        if self._worker is None:
            self._worker = _Worker(self.name)
        outcome, done = Outcome(), threading.Event()
        self._worker.calls.put((fn, args, outcome, done))
        if done.wait(self._wait):
            return outcome
        # Given up on: the thread keeps the call, and its queue's ``None`` ends it once the call returns.
        self._worker.calls.put(None)
        self._hung.append(self._worker.thread)
        self._worker = None
        return Outcome(timed_out=True)

    def close(self) -> None:
        """End the idle worker thread; a later call starts another."""
        if self._worker is not None:
            self._worker.calls.put(None)
            self._worker = None
