"""The rollouter: feeds prompts one at a time to the rollout engines and queues what they finish.

It runs beside the training loop in a thread of the driver; the generation itself happens on the
rollout workers (Ray actors), many samples at once. Each prompt is a sample with
``sample_id = sample_{epoch}_{index}`` (``index`` counts every prompt fed, from 1, across epochs),
the call skip's ``async_rollout`` role wraps. Staleness control: it stops feeding once the
samples fed since the last weight sync reach ``limit``, and goes on when the trainer syncs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from skip_core.schedule import EPOCH, INDEX_BASE, LOADER_STATE_BEFORE, Run


@dataclass
class Fed:
    """Where each fed prompt came from, for a checkpoint to know where to resume."""

    first_index: dict[int, int] = field(default_factory=dict)  # loader batch number -> its first feed index
    size: dict[int, int] = field(default_factory=dict)  # loader batch number -> its prompts
    state_before: dict[int, dict] = field(default_factory=dict)  # loader batch number -> loader state before it

    def resume_point(self, trained: set[int]) -> tuple[dict | None, dict]:
        """Where a run resumed after ``trained`` starts: the loader batch holding the first prompt
        not trained yet (fed or not), skipping the prompts after it that were trained."""
        for number in sorted(self.first_index):
            first = self.first_index[number]
            if any(index not in trained for index in range(first, first + self.size[number])):
                after = sorted(index for index in trained if index >= first)
                return self.state_before[number], {"next_index": first, "next_batch": number, "trained": after}
        number = max(self.first_index, default=0) + 1
        first = max((f + self.size[n] for n, f in self.first_index.items()), default=1)
        return None, {"next_index": first, "next_batch": number, "trained": []}


class Rollouter:
    def __init__(self, run: Run, limit: int, total: int, resume: dict | None) -> None:
        self.run, self.limit, self.total = run, limit, total
        self.results: queue.Queue[tuple[int | None, Any]] = queue.Queue()
        self.fed = Fed()
        self._cond = threading.Condition()
        self._since_sync = 0  # samples fed since the last weight sync (staleness control)
        self._in_flight = 0
        self._holding = False  # a sync without partial rollout waits for the samples in flight
        self._stopped = False
        self._idle_s, self._idle_from = 0.0, time.perf_counter()
        resume = resume or {}
        self._next_index = resume.get("next_index", 1)
        self._next_batch = resume.get("next_batch", 1)
        self.trained_before = set(resume.get("trained", []))
        self._thread = threading.Thread(target=self._feed_all, name="skip-rollouter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    # -- the trainer's side ------------------------------------------------------------

    def take(self, count: int) -> list[tuple[int, Any]]:
        """``count`` finished samples as ``(feed index, batch)``, in the order they finished;
        a failed generation or a failed rollouter raises here, failing the run."""
        taken = []
        while len(taken) < count:
            index, item = self.results.get()
            if index is None:
                raise item
            taken.append((index, item.result()))
        return taken

    def hold(self) -> None:
        """Stop feeding and wait until no sample is in flight (a sync without partial rollout)."""
        with self._cond:
            self._holding = True
            self._cond.wait_for(lambda: self._in_flight == 0 or self._stopped)

    def synced(self) -> None:
        """Weights moved: what is in flight or queued carries over into the new window."""
        with self._cond:
            self._holding = False
            self._since_sync = self._in_flight + self.results.qsize()
            self._cond.notify_all()

    def idle_seconds(self) -> float:
        """Seconds with no sample in flight since the last call (the rollouter's idle time)."""
        with self._cond:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_from if self._in_flight == 0 else 0.0)
            self._idle_s, self._idle_from = 0.0, now
            return idle

    # -- the feeding thread ---------------------------------------------------------------

    def _feed_all(self) -> None:
        try:
            for index, batch_number, row, sample_id in self._rows():
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped or (self._since_sync < self.limit and not self._holding))
                    if self._stopped:
                        return
                    self._since_sync += 1
                    if self._in_flight == 0:
                        self._idle_s += time.perf_counter() - self._idle_from
                    self._in_flight += 1
                future = self.run.generate(row, batch_number, sample_id=sample_id)
                future.add_done_callback(lambda done, index=index: self._finished(index, done))
        except BaseException as exc:  # the trainer must fail with it, never finish as a success
            self.results.put((None, exc))

    def _finished(self, index: int, future: Future) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_from = time.perf_counter()
            self.results.put((index, future))
            self._cond.notify_all()

    def _rows(self) -> Iterator[tuple[int, int, Any, str]]:
        """Every prompt still to feed, one row at a time, as the trainer's loader yields them."""
        fed = 0
        while fed < self.total:
            batch = self.run.prompts()
            number = self._next_batch
            self._next_batch += 1
            self.fed.first_index[number], self.fed.size[number] = self._next_index, len(batch)
            self.fed.state_before[number] = batch.meta_info[LOADER_STATE_BEFORE]
            epoch = batch.meta_info[EPOCH]
            for row in range(len(batch)):
                index = self._next_index
                self._next_index += 1
                if index in self.trained_before:  # trained before the run was interrupted
                    continue
                if fed == self.total:
                    return
                fed += 1
                sample = batch[row : row + 1]
                # Seeded and named as the row of its whole batch would be: staleness 0 equals sync.
                sample.meta_info = {INDEX_BASE: row}
                yield index, number, sample, f"sample_{epoch}_{index}"
