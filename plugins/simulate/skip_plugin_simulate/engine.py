"""Rollout engines with continuous batching, in virtual time.

An engine decodes each running request one token per decode step, a step lasting
``decode_s + decode_s_per_row x rows``. A request joins at the next step, after its prefill
(``prefill_s_per_token`` per token of context, during which the engine decodes nothing), and
leaves at the step that ends its turn; between turns it waits out of the batch for its tool.
At most ``max_batch`` requests run and the rest queue. Between two changes of the running set
every request advances at the same rate, so an engine computes when the next one ends instead
of stepping token by token: a run of 400 steps on 128 engines is a few hundred thousand events.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from skip_plugin_simulate.clock import Clock
from skip_plugin_simulate.config import Engines
from skip_plugin_simulate.workload import Shape

_EPS = 1e-6  # tokens: what float rounding may leave of a finished turn


@dataclass(eq=False, slots=True)
class Request:
    """One sample in flight: its shape, and how far it got."""

    shape: Shape
    version: int  # the weights it started with
    on_done: Callable[[Request], None]
    turn: int = 0
    context: int = 0  # tokens in its KV cache so far
    prefill: int = 0  # tokens to prefill when it next joins a batch
    last_version: int = 0
    interruptions: int = 0
    finished_at: float = 0.0

    def __post_init__(self) -> None:
        self.prefill, self.last_version = self.shape.prompt_tokens, self.version

    @property
    def response_tokens(self) -> int:
        return sum(self.shape.turns)


class Engine:
    """Every running request decodes one token per step, so one number, the tokens each has
    decoded since the engine started (``_progress``), says how far all of them are; a request's
    turn ends at a progress fixed when it joins, and a heap of those ends gives the next one."""

    def __init__(self, clock: Clock, spec: Engines) -> None:
        self.clock, self.spec = clock, spec
        self.queue: deque[Request] = deque()
        self.away = 0  # requests out of the batch for a tool call
        self.paused = False
        self.busy_s = 0.0  # seconds prefilling or decoding
        self.tokens = 0.0
        self._ends: list[tuple[float, int, Request]] = []  # (progress at which its turn ends, order, request)
        self._order = itertools.count()
        self._progress = 0.0
        self._stall = 0.0  # prefill seconds left before decoding goes on
        self._since = 0.0
        self._wake_at = math.inf  # the earliest event scheduled; a later one finding less due is a no-op

    @property
    def running(self) -> int:
        return len(self._ends)

    def submit(self, request: Request) -> None:
        """Queue ``request``; it joins at this instant, once every submit of the instant is in
        (a step's thousands of submits make one update, not one each)."""
        self.queue.append(request)
        self._wake(self.clock.now)

    def pause(self) -> None:
        """Stop after the tokens so far; requests keep their progress (partial rollout)."""
        self._update()
        self.paused = True
        self._wake_at = math.inf

    def resume(self) -> None:
        """Go on; the requests that ran prefill their context again (their KV cache is gone)."""
        self.paused = False
        self._stall += self.spec.prefill_s_per_token * sum(request.context for _, _, request in self._ends)
        self._since = self.clock.now
        self._update()

    def advance(self) -> None:
        """Bring progress and busy time up to now (rates hold until the running set changes)."""
        elapsed = self.clock.now - self._since
        self._since = self.clock.now
        if self.paused or not self._ends:
            return
        stall = min(elapsed, self._stall)
        self._stall -= stall
        self.busy_s += elapsed
        tokens = (elapsed - stall) / self._step_s()
        self._progress += tokens
        self.tokens += tokens * len(self._ends)

    def _step_s(self) -> float:
        return self.spec.decode_s + self.spec.decode_s_per_row * len(self._ends)

    def _update(self) -> None:
        self.advance()
        while self._ends and self._ends[0][0] <= self._progress + _EPS:
            self._end_turn(heapq.heappop(self._ends)[2])
        while self.queue and not self.paused and len(self._ends) < self.spec.max_batch:
            request = self.queue.popleft()
            self._stall += self.spec.prefill_s_per_token * request.prefill
            request.context += request.prefill
            request.prefill = 0
            end = self._progress + request.shape.turns[request.turn]
            heapq.heappush(self._ends, (end, next(self._order), request))
        if self.paused or not self._ends:
            return
        self._wake(self.clock.now + self._stall + (self._ends[0][0] - self._progress) * self._step_s())

    def _wake(self, when: float) -> None:
        """Update at ``when`` unless an update comes sooner: that one reschedules. Keeping one
        event per engine keeps the clock's heap small (an event per change grows it by millions)."""
        if when < self._wake_at:
            self._wake_at = when
            self.clock.at(when, self._due)

    def _due(self) -> None:
        if self.clock.now >= self._wake_at:  # else a sooner event came and rescheduled
            self._wake_at = math.inf
            self._update()

    def _end_turn(self, request: Request) -> None:
        request.context += request.shape.turns[request.turn]
        request.turn += 1
        if request.turn == len(request.shape.turns):
            request.finished_at = self.clock.now
            request.on_done(request)
            return
        request.prefill = request.shape.tool_tokens
        self.away += 1

        def back() -> None:
            self.away -= 1
            self.submit(request)

        self.clock.after(request.shape.tool_s, back)


class Rollout:
    """The engines of a run: a request goes to the engine with the fewest unfinished requests,
    as a router would send it (a heap with stale entries skipped keeps that O(log engines))."""

    def __init__(self, clock: Clock, spec: Engines, count: int) -> None:
        self.engines = [Engine(clock, spec) for _ in range(count)]
        self.in_flight: dict[Request, int] = {}  # request -> its engine
        self._load = [0] * count
        self._least = [(0, index) for index in range(count)]

    def submit(self, request: Request) -> None:
        while True:
            load, index = heapq.heappop(self._least)
            if load == self._load[index]:
                break
        self._set_load(index, load + 1)
        self.in_flight[request] = index
        self.engines[index].submit(request)

    def done(self, request: Request) -> None:
        index = self.in_flight.pop(request)
        self._set_load(index, self._load[index] - 1)

    def _set_load(self, index: int, load: int) -> None:
        self._load[index] = load
        heapq.heappush(self._least, (load, index))

    def pause(self) -> None:
        for engine in self.engines:
            engine.pause()

    def resume(self, version: int) -> None:
        """New weights: every request in flight goes on with them."""
        for request in self.in_flight:
            request.interruptions += 1
            request.last_version = version
        for engine in self.engines:
            engine.resume()
