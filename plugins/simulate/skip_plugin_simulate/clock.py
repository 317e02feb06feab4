"""Virtual time for a schedule that runs on real threads.

A schedule plugin runs unchanged against the simulated ``Run``: its ``fit`` runs in a thread of
its own and may start more (fully_async's rollouter feeds from one). Simulated work (a
generation, a training step, a weight sync) ends at a virtual time. The clock moves to the next
such end only once every thread of the simulation waits, on a simulated result or on another
thread, so whatever a schedule does in answer to an event happens at that event's virtual time,
and 400 steps of minutes each take seconds.

Waiting is read from the threads' stacks: ``threading.Condition.wait`` with its waiter still
queued (locks, events, queues and futures all wait there), or a ``Thread.join``. A thread
anywhere else is running, and the clock waits for it. Every simulated state change happens
under one lock; what wakes a schedule's thread (a future's result, an event set) is deferred
with ``wake`` until the lock is released, so the schedule's own locks are never taken under it.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from types import FrameType

_CONDITION_WAIT = threading.Condition.wait.__code__
_JOIN = threading.Thread._wait_for_tstate_lock.__code__
_GC_THRESHOLD = 100_000  # allocations between two collections of the young generation
_POLL_S = 0.0  # between two looks at a running thread: hands it the GIL, no more


class Deadlock(RuntimeError):
    """Every thread of the simulation waits and no simulated work is left to end."""


class Clock:
    def __init__(self, foreign_s: float = 5.0) -> None:
        self.now = 0.0
        self.foreign_s = foreign_s
        self.lock = threading.RLock()  # held while an event changes the simulated state
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wakes: list[Callable[[], None]] = []

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` (under ``lock``) when virtual time reaches ``when``."""
        with self.lock:
            heapq.heappush(self._events, (max(when, self.now), next(self._order), callback))

    def wake(self, call: Callable[[], None]) -> None:
        """Call ``call`` once the event being applied is done and the lock released."""
        self._wakes.append(call)

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + delay, callback)

    def sleep(self, delay: float) -> None:
        """Block the calling thread of the simulation for ``delay`` virtual seconds."""
        done = threading.Event()
        self.after(delay, lambda: self.wake(done.set))
        done.wait()

    def run(self, target: Callable[[], None]) -> None:
        """Run ``target`` in a thread of its own under virtual time; return when it returns,
        raising what it raised. ``Deadlock`` names where each thread waits."""
        before = set(threading.enumerate())
        failure: list[BaseException] = []
        returned = threading.Event()

        def main() -> None:
            try:
                target()
            except BaseException as exc:  # re-raised in the caller's thread
                failure.append(exc)
            finally:
                returned.set()

        # Millions of short-lived objects (requests, events, batches): collecting the young
        # generation at CPython's default threshold took a third of a run at cluster scale.
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], _GC_THRESHOLD), *threshold[1:])
        try:
            threading.Thread(target=main, name="skip-simulate", daemon=True).start()
            self._loop(before, returned)
        finally:
            gc.set_threshold(*threshold)
        if failure:
            raise failure[0]

    def _loop(self, before: set[threading.Thread], returned: threading.Event) -> None:
        woken = True  # threads run only after a wake: an event that wakes no one needs no settling
        while True:
            if woken:
                self._settle(before)
            if returned.is_set():
                break
            with self.lock:
                if not self._events:
                    raise Deadlock(f"at t={self.now:.3f} s every thread waits and nothing runs:\n{_stacks(before)}")
                when, _, callback = heapq.heappop(self._events)
                self.now = when
                callback()
                wakes, self._wakes = self._wakes, []
            for call in wakes:
                call()
            woken = bool(wakes)

    def _settle(self, before: set[threading.Thread]) -> None:
        """Return once every thread started since ``before`` waits or has ended. A thread that
        stays at one instruction for ``foreign_s`` (blocked in C: a socket, a foreign lock) is
        not the simulation's, a library's background thread born meanwhile: it is left out."""
        me = threading.current_thread()
        still: dict[threading.Thread, tuple[int, int, float]] = {}
        while True:
            frames = sys._current_frames()
            # A thread without a frame is starting or ending: running, for an instant.
            running = [
                t
                for t in threading.enumerate()
                if t not in before and t is not me and not _waits(frames.get(t.ident), frames)
            ]
            if not running:
                return
            now = time.monotonic()
            for thread in running:
                frame = frames.get(thread.ident)
                where = (id(frame), frame.f_lasti if frame else -1)
                seen = still.get(thread)
                if seen is None or seen[:2] != where:
                    still[thread] = (*where, now)
                elif now - seen[2] > self.foreign_s:
                    warnings.warn(f"thread {thread.name!r} is not the simulation's: left out", stacklevel=2)
                    before.add(thread)
            time.sleep(_POLL_S)


def _waits(frame: FrameType | None, frames: dict[int, FrameType]) -> bool:
    if frame is None:
        return False
    if frame.f_code is _JOIN:  # waits while the thread it joins still runs Python code
        return frame.f_locals.get("self").ident in frames
    if frame.f_code is not _CONDITION_WAIT:
        return False
    names = frame.f_locals
    condition, waiter = names.get("self"), names.get("waiter")
    # notify() takes the waiter out of the queue before releasing it: queued means not woken.
    return waiter is not None and waiter in getattr(condition, "_waiters", ())


def _stacks(before: set[threading.Thread]) -> str:
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        if thread not in before and thread.ident in frames and thread is not threading.current_thread():
            stack = "".join(traceback.format_stack(frames[thread.ident])[-4:])
            parts.append(f"thread {thread.name}:\n{stack}")
    return "\n".join(parts)
