"""The driver's handle on the rollout workers: the unit skip's rollout roles wrap, and where a lost
worker is survived.

A rollout worker is routinely lost on a cluster (preemption, the OOM killer, a node going
away). Ray restarts it (``resources.rollout.max_restarts``): its constructor runs again and its
engine loads the model from disk. The group then gives it the weights of the last sync before
anything else, and asks it again for what it was doing. A batch part is seeded by its rows, so
the redone part is the one an uninterrupted run gets. A worker Ray cannot restart is a
``WorkerLost``, which names it.

Weights move in buckets (``rollout/weights.py``): over a process group that the actor's rank 0
and every engine process join (``group_sync.py``, ``rollout.weight_sync``), or through the object
store, where the actor puts each bucket once, one bucket ahead of the workers loading the one
before; either way a sync holds two buckets at most. A worker started or restarted between syncs
gets its weights through the object store.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from skip_core import spans
from skip_core.batch import Batch
from skip_core.manager import SkipManager
from skip_core.schedule import GLOBAL_STEPS, INDEX_BASE, VALIDATE

from skip_plugin_trainer.actors import Where, settle
from skip_plugin_trainer.rollout.group_sync import GroupSync
from skip_plugin_trainer.rollout.padding import ROLLOUT_LAYOUT
from skip_plugin_trainer.rollout.stats import merge_rollout_stats

SHUTDOWN_TIMEOUT_S = 120
RESTART_POLL_S = 2  # how often a wait for a restart looks whether the worker's node is gone


class WorkerLost(RuntimeError):
    """A Ray worker of the run died and was not restarted; the message names it and where it ran."""


class Weights(Protocol):
    """The weights of a sync, as the actor publishes them (``train.model_group.WeightSource``):
    ``count`` buckets of step ``version``, each an object ref."""

    count: int
    version: int

    def publish(self, version: int) -> None: ...

    def buckets(self) -> Iterator[tuple[int, Any]]: ...


class RolloutGroup:
    """The rollout workers, seen from the driver as one engine.

    A cache hit replaces the whole call, so no worker is asked for anything: ``calls`` counts
    the batches that really reached the workers. Workers not ``started`` (train-only) are
    spawned by the first call that reaches them. Both a worker started late and one restarted
    load the weights of the last sync first.
    """

    def __init__(
        self,
        spawn: Callable[[], list[Any]],
        started: bool = True,
        restart_timeout_s: float = 600,
        group_sync: GroupSync | None = None,
    ) -> None:
        self._spawn, self._restart_timeout_s, self.group_sync = spawn, restart_timeout_s, group_sync
        self.membership = 0  # counts the changes of workers: a weight group formed before must form again
        self.workers: list[Any] = []
        self.calls = 0
        self.restarts = 0
        self._step = 0  # of the last generation: the step a lost worker is named at
        self.asleep = False
        self._discarded = False  # the engines' weights, until the next sync
        self._turn = 0
        self._lock = threading.Lock()
        self._weights: Weights | None = None  # of the last sync
        self._where: list[Any] = []  # each worker's answer to ``where``: the process to name if it is lost
        self._gone: set[int] = set()  # ranks Ray did not restart: nothing more is asked of them
        # Held to publish weights and give them to workers, so a worker restored by one thread
        # never gets a mix of two versions from another's publish; reentrant, as a worker lost
        # while a sync gives it the weights is restored from inside that sync.
        self._giving = threading.RLock()
        if started:
            self._use(spawn())

    def _use(self, workers: list[Any]) -> None:
        self._where = [worker.where.remote() for worker in workers]
        self.workers = workers
        self.membership += 1

    def _started(self, prompts: Batch) -> list[Any]:
        with self._lock:
            if self.workers:
                return self.workers
            step = prompts.meta_info.get(GLOBAL_STEPS)
            what = "validation" if prompts.meta_info.get(VALIDATE) else f"the generation of step {step}"
            warnings.warn(
                f"starting the rollout engines: {what} is not in the skip cache", RuntimeWarning, stacklevel=3
            )
            with spans.span("engine_start"):
                workers = self._spawn()
                settle([worker.__ray_ready__.remote() for worker in workers], "starting the rollout engines", "engines")
                with self._giving:
                    self._use(workers)
                    self._push(range(len(workers)), False, "while it was given the weights")
            return workers

    @SkipManager.annotate(role="rollout", layout=ROLLOUT_LAYOUT)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Split the prompts evenly across workers, generate concurrently, and rejoin in order."""
        self.calls += 1
        workers = self._started(prompts)
        parts = prompts.chunk(len(workers))
        base = int(prompts.meta_info.get(INDEX_BASE, 0))
        for rank, part in enumerate(parts):
            part.meta_info = {**prompts.meta_info, INDEX_BASE: base + rank * len(part)}
        self._step = prompts.meta_info.get(GLOBAL_STEPS, self._step)
        calls = {rank: (part,) for rank, part in enumerate(parts)}
        done = self._gather("generate_sequences", calls, "while generating", barrier=True)
        outputs = [done[rank] for rank in range(len(parts))]
        with spans.span("batch_construction", workers=len(outputs)):
            merged = Batch.concat(outputs)
            merged.meta_info = {"rollout": merge_rollout_stats([out.meta_info["rollout"] for out in outputs])}
        return merged

    @SkipManager.annotate(role="async_rollout", layout=ROLLOUT_LAYOUT)
    async def generate_sequences_single(self, prompts: Batch, sample_id: str) -> Batch:
        """One streamed prompt (``sample_{epoch}_{index}``), on the workers in turn: the unit skip's
        ``async_rollout`` role wraps. Workers take many at once; their engines batch them. A sample
        lost with its worker is generated again from its start (its seed is its id's)."""
        self.calls += 1
        self._step = prompts.meta_info.get(GLOBAL_STEPS, self._step)
        workers = await asyncio.to_thread(self._started, prompts)
        rank = self._turn % len(workers)
        self._turn += 1
        while True:
            try:
                return await self.workers[rank].generate_sequences.remote(prompts)
            except RayActorError as exc:
                await asyncio.to_thread(self._recover, rank, exc, f"while generating {sample_id}")

    def _gather(
        self, method: str, calls: Mapping[int, tuple], what: str, redo: bool = True, barrier: bool = False
    ) -> dict[int, Any]:
        """``method(*calls[rank])`` on those workers, the results by rank; with ``barrier`` each
        worker's wait for the slowest is a ``barrier_wait`` span. A lost worker is restarted and,
        with ``redo``, asked again; without, its rank is missing from the results."""
        rank_of = {getattr(self.workers[rank], method).remote(*args): rank for rank, args in calls.items()}
        arrived: dict[int, float] = {}
        results: dict[int, Any] = {}
        pending = list(rank_of)
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except RayActorError as exc:
                self._recover(rank, exc, what)
                if redo:
                    retry = getattr(self.workers[rank], method).remote(*calls[rank])
                    rank_of[retry] = rank
                    pending.append(retry)
                continue
            arrived[rank] = time.time()
        if barrier and arrived:
            last = max(arrived.values())
            for rank, at in arrived.items():
                spans.record("barrier_wait", at, last, workid=rank)
        return results

    def _push(self, ranks: Iterable[int], interrupt: bool, what: str) -> None:
        """The weights of the last sync to workers ``ranks``, bucket by bucket. A worker lost on the
        way got them whole when it was restarted, and takes no more buckets of this push."""
        source, ranks = self._weights, list(ranks)
        if source is None:
            return
        for index, ref in source.buckets():
            args = (ref, index, source.count, source.version, interrupt)
            done = self._gather("load_weights_bucket", dict.fromkeys(ranks, args), what, redo=False)
            ranks = [rank for rank in ranks if rank in done]
            if not ranks:
                return

    def _recover(self, rank: int, error: Exception, what: str) -> None:
        """Wait for Ray to restart worker ``rank``, then give it the weights of the last sync.
        Calls that lost the same worker wait here; the first to come restores it."""
        with self._giving:
            if rank in self._gone:
                raise WorkerLost(f"rollout worker {rank} was lost before, and Ray did not restart it") from error
            lost = self._lost_where(rank)
            now = self.workers[rank].where.options(max_task_retries=-1).remote()  # waits out the restart
            where = self._restarted(rank, now, lost, error, what)
            if where == lost:  # alive all along (a transient loss), or restored by another call
                return
            self._where[rank] = now
            self._push([rank], False, "while it was given the weights after a restart")  # outside any group
            self.restarts += 1
            self.membership += 1
            version = 0 if self._weights is None else self._weights.version
            warnings.warn(
                f"rollout worker {rank} ({lost}) was lost at step {self._step}, noticed {what}; Ray restarted "
                f"it ({where}), which loaded the weights of step {version} and takes up its work again",
                RuntimeWarning,
                stacklevel=2,
            )

    def _lost_where(self, rank: int) -> Where | str:
        try:
            return ray.get(self._where[rank], timeout=1)
        except (RayActorError, GetTimeoutError):
            return "a process that died before it said where"

    def _restarted(self, rank: int, now: Any, lost: Where | str, error: Exception, what: str) -> Where:
        """Where the restarted worker runs, once Ray has placed it again and its engine has loaded.
        A worker whose node is gone may wait for another node, up to the restart timeout: said
        once Ray counts the node dead, which it does some seconds after the worker's calls fail."""
        deadline = time.monotonic() + self._restart_timeout_s
        said = False
        while not ray.wait([now], timeout=min(RESTART_POLL_S, max(deadline - time.monotonic(), 0)))[0]:
            if time.monotonic() >= deadline:
                cause = f"not back within resources.rollout.restart_timeout_s={self._restart_timeout_s:g}"
                if _node_gone(lost):
                    cause = f"its node is gone and no node left took the worker within {self._restart_timeout_s:g} s"
                raise self._not_restarted(rank, lost, what, cause) from error
            if not said and _node_gone(lost):
                said = True
                warnings.warn(
                    f"rollout worker {rank} ({lost}) was lost with its node at step {self._step}; waiting up to "
                    f"{self._restart_timeout_s:g} s for Ray to restart it on another "
                    "(resources.rollout.restart_timeout_s)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        try:
            return ray.get(now)
        except RayActorError as exc:  # past resources.rollout.max_restarts: Ray gave up on it
            cause = str(error).splitlines()[0].rstrip(".")
            raise self._not_restarted(rank, lost, what, f"past resources.rollout.max_restarts: {cause}") from exc

    def each(self, method: str, what: str) -> dict[int, Any]:
        """``method()`` on every worker, the results by rank."""
        return self._gather(method, dict.fromkeys(range(len(self.workers)), ()), what)

    def lost(self, rank: int, what: str, cause: str) -> WorkerLost:
        """Worker ``rank``, lost ``what``, where nothing can wait for its restart."""
        self._gone.add(rank)
        return WorkerLost(
            f"rollout worker {rank} ({self._lost_where(rank)}) was lost at step {self._step} {what}: {cause}"
        )

    def _not_restarted(self, rank: int, lost: Where | str, what: str, cause: str) -> WorkerLost:
        self._gone.add(rank)
        return WorkerLost(
            f"rollout worker {rank} ({lost}) died at step {self._step}, noticed {what}, and Ray did not restart it: "
            f"{cause}"
        )

    def update_weights(self, source: Weights, version: int, interrupt: bool = False) -> None:
        """Send the actor's weights of step ``version``; ``interrupt`` pauses generations in
        flight instead of requiring none. They stay published: a worker started or restarted
        later loads them first."""
        with self._giving:
            source.publish(version)
            self._weights = source
            if not self.workers:  # started later, under this lock, with these weights
                return
            with spans.span("weight_sync"):
                if self.group_sync is not None:
                    self.group_sync.sync(self, source, interrupt)
                else:
                    self._push(range(len(self.workers)), interrupt, "during a weight sync")
            self._discarded = False

    def sleep(self, keep_weights: bool = True) -> None:
        """Colocated engines free their device memory while the actor trains (``resources.colocate``);
        without ``keep_weights`` the weights are discarded, and only a sync brings them back."""
        calls = dict.fromkeys(range(len(self.workers)), (keep_weights,))
        self._gather("sleep", calls, "while going to sleep", redo=False)
        self.asleep, self._discarded = True, not keep_weights

    def wake_up(self, part: str | None = None) -> None:
        """``part`` (``"weights"``, then ``"kv_cache"``; None: both) back before weights load or anything
        generates; a worker restarted meanwhile is awake already."""
        if part != "weights" and self._discarded:
            raise RuntimeError("the engines' weights were discarded at sleep: a weight sync must come first")
        calls = dict.fromkeys(range(len(self.workers)), (part,))
        self._gather("wake_up", calls, "while waking up", redo=False)
        self.asleep = part == "weights"

    def engine_counters(self) -> dict[str, float]:
        """Every worker's engine counters (``RolloutBackend.counters``), summed."""
        total: dict[str, float] = {}
        calls = dict.fromkeys(range(len(self.workers)), ())
        for counts in self._gather("engine_counters", calls, "while reading its counters").values():
            for name, value in counts.items():
                total[name] = total.get(name, 0.0) + value
        return total

    def shutdown(self) -> None:
        """Bounded: an engine that never stops must not hang the run's exit (its pool kills it)."""
        live = [worker for rank, worker in enumerate(self.workers) if rank not in self._gone]
        ray.get([worker.shutdown.remote() for worker in live], timeout=SHUTDOWN_TIMEOUT_S)


def _node_gone(lost: Where | str) -> bool:
    return isinstance(lost, Where) and not lost.node_alive()
