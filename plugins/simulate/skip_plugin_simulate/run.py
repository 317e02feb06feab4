"""A trainer in virtual time: ``skip_core.schedule.Run`` with no model and no Ray.

A schedule plugin cannot tell it from the real trainer: ``generate`` returns a future that
the simulated engines complete, ``train`` and ``sync_weights`` block for their modelled time,
``step`` checkpoints and logs. What it logs is measured on the virtual clock, not read from
the schedule's own timers, which run in real time.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import numpy as np
from skip_core.batch import Batch
from skip_core.schedule import EPOCH, GENERATE_S, LOADER_STATE, LOADER_STATE_BEFORE, WEIGHT_SYNC, StepRecord

from skip_plugin_simulate.clock import Clock
from skip_plugin_simulate.config import Simulation
from skip_plugin_simulate.engine import Request, Rollout
from skip_plugin_simulate.workload import VALIDATION_SEED, Workload


class Crash(RuntimeError):
    """The simulated trainer stopped at the start of a step, as a killed run would."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    loader: dict
    schedule_state: dict | None


@dataclass
class Timeline:
    """What a simulated run did: one row of metrics per step, and each step's samples."""

    rows: list[dict[str, float]] = field(default_factory=list)
    trained: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # step -> (epoch, prompt, offset)
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    crashed: bool = False
    peak_in_flight: int = 0  # samples submitted and not finished, at most
    staleness: Counter[int] = field(default_factory=Counter)  # updates behind -> trained samples
    #: At each weight sync after the first: the prompts fed or trained-pending when the window
    #: before it opened (carried over), and the prompts fed during it: what a staleness bound caps.
    windows: list[tuple[int, int]] = field(default_factory=list)
    engines: int = 0
    trainer_devices: int = 0


class SimulatedRun:
    def __init__(
        self,
        sim: Simulation,
        overlapped: bool,
        clock: Clock,
        workload: Workload | None = None,
        val_workload: Workload | None = None,
        resume: Checkpoint | None = None,
        crash_at: int = 0,
    ) -> None:
        self.sim, self.clock, self.overlapped, self.crash_at = sim, clock, overlapped, crash_at
        self.train_batch_size, self.ppo_mini_batch_size = sim.data.train_batch_size, sim.actor.ppo_mini_batch_size
        devices, split = sim.cluster.devices, sim.cluster.rollout_devices
        shared = sim.cluster.colocated and not overlapped
        self.trainer_devices = devices if shared else devices - split
        self.engine_count = (devices if shared else split) // sim.engines.devices_per_engine
        self.rollout = Rollout(clock, sim.engines, self.engine_count)
        self.workload = workload or Workload(sim.requests, sim.trainer.seed)
        self.timeline = Timeline(engines=self.engine_count, trainer_devices=self.trainer_devices)
        self.global_steps = resume.step if resume else 0
        self._actor_version = self._rollout_version = self.global_steps
        self._loader = dict(resume.loader) if resume else {"epoch": 0, "index": 0}
        self._resume_state = resume.schedule_state if resume else None
        self._loader_states: dict[int, dict] = {}
        self._pending: set[Future] = set()  # generations in flight
        self.val_workload = val_workload or Workload(sim.requests, sim.trainer.seed + VALIDATION_SEED)
        self._busy_before = 0.0
        self._spent = {"train": 0.0, "sync": 0.0, "testing": 0.0}  # this step's virtual seconds in each
        self._fed = self._trained = self._fed_in_window = self._carried = 0  # prompts
        self._synced_once = False

    # -- skip_core.schedule.Run --------------------------------------------------------

    def steps(self) -> range:
        return range(self.global_steps + 1, self.sim.trainer.total_training_steps + 1)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[StepRecord]:
        if step == self.crash_at:
            raise Crash(f"the simulated trainer stopped at step {step}")
        record, start = StepRecord(step), self.clock.now
        self._spent = {"train": 0.0, "sync": 0.0, "testing": 0.0}
        yield record
        freq = self.sim.trainer.save_freq
        if freq > 0 and step % freq == 0:
            loader = record.loader_state or self._loader_states.get(step) or self._loader  # as the trainer saves it
            self.timeline.checkpoints[step] = Checkpoint(step, dict(loader), record.schedule_state)
        self.global_steps = step
        self._loader_states.pop(step, None)
        self.timeline.rows.append(self._row(record, start))

    def prompts(self) -> Batch:
        before = dict(self._loader)
        first, size = before["index"], self.train_batch_size
        indices = [(first + i) % self.sim.data.prompts for i in range(size)]
        epochs = [before["epoch"] + (first + i) // self.sim.data.prompts for i in range(size)]
        after = {
            "epoch": epochs[-1] + (indices[-1] + 1) // self.sim.data.prompts,
            "index": (indices[-1] + 1) % self.sim.data.prompts,
        }
        self._loader = after
        meta = {EPOCH: before["epoch"], LOADER_STATE_BEFORE: before, LOADER_STATE: dict(after)}
        return Batch(non_tensor_batch={"prompt": np.array(indices), "epoch": np.array(epochs)}, meta_info=meta)

    def resume_state(self) -> dict | None:
        return self._resume_state

    def generate(self, prompts: Batch, step: int, sample_id: str | None = None) -> Future:
        state = prompts.meta_info.get(LOADER_STATE)
        if sample_id is None and state is not None:
            self._loader_states[step] = state
        n, columns = self.sim.rollout.n, prompts.non_tensor_batch
        rows = {
            "epoch": np.repeat(columns["epoch"], n),
            "prompt": np.repeat(columns["prompt"], n),
            "offset": np.tile(np.arange(n), len(prompts)),
        }
        with self.clock.lock:
            self._fed += len(prompts)
            self._fed_in_window += len(prompts)
            return self._launch(rows, self.workload)

    def _launch(self, rows: dict[str, np.ndarray], workload: Workload) -> Future:
        """Submit one request per row (its epoch, prompt and offset); the future's batch comes
        when the last one ends."""
        future: Future = Future()
        done: list[Request] = []
        start = self.clock.now

        def finished(request: Request) -> None:
            self.rollout.done(request)
            done.append(request)
            if len(done) == len(requests):
                self._pending.discard(future)
                batch = self._batch(rows, requests, self.clock.now - start)
                self.clock.wake(lambda: future.set_result(batch))

        shapes = workload.draw(rows["epoch"], rows["prompt"], rows["offset"])
        with self.clock.lock:
            self._pending.add(future)
            version = self._rollout_version
            requests = [Request(shape, version, finished) for shape in shapes]
            for request in requests:
                self.rollout.submit(request)
            self.timeline.peak_in_flight = max(self.timeline.peak_in_flight, len(self.rollout.in_flight))
        return future

    def train(self, batch: Batch, record: StepRecord) -> None:
        record.batch = batch
        extras = batch.non_tensor_batch
        stale = self._actor_version - extras["min_weight_version"]
        record.metrics["training/staleness"] = float(stale.mean())
        record.metrics["training/staleness_max"] = float(stale.max())
        self.timeline.staleness.update(stale.tolist())
        tokens = float(extras["prompt_tokens"].sum() + extras["response_tokens"].sum())
        seconds = self.sim.training.fixed_s + self.sim.training.s_per_token * tokens / self.trainer_devices
        self.clock.sleep(seconds)
        self._spent["train"] += seconds
        self._actor_version = record.step
        self._trained += len(batch) // self.sim.rollout.n
        self.timeline.trained[record.step] = list(
            zip(extras["epoch"].tolist(), extras["prompt"].tolist(), extras["offset"].tolist(), strict=True)
        )

    def sync_weights(self, interrupt: bool = False) -> None:
        if not interrupt and self._pending:
            raise RuntimeError("sync_weights: a generation is in flight; wait for it first")
        colocated = self.sim.cluster.colocated and not self.overlapped
        seconds = self.sim.weight_sync.seconds + (self.sim.weight_sync.colocated_switch_s if colocated else 0.0)
        with self.clock.lock:
            if interrupt:
                self.rollout.pause()
        self.clock.sleep(seconds)
        with self.clock.lock:
            if self._synced_once:
                self.timeline.windows.append((self._carried, self._fed_in_window))
            self._synced_once = True
            self._carried, self._fed_in_window = self._fed - self._trained, 0
            self._rollout_version = self._actor_version
            if interrupt:
                self.rollout.resume(self._rollout_version)
        self._spent["sync"] += seconds

    def after_update(self, record: StepRecord, interrupt: bool = False) -> None:
        """Validation as the trainer runs it: the engines get the new weights (after the
        generations in flight, or at once with ``interrupt``), then the validation prompts
        generate and the trainer waits for them."""
        freq, last = self.sim.trainer.test_freq, record.step == self.sim.trainer.total_training_steps
        if freq <= 0 or not self.sim.data.val_prompts or not (record.step % freq == 0 or last):
            return
        start = self.clock.now
        while not interrupt and self._pending:  # a streaming schedule may start more meanwhile
            wait(list(self._pending))
        if self._rollout_version != self._actor_version:
            self.sync_weights(interrupt)
        prompts, n = self.sim.data.val_prompts, self.sim.rollout.val_n
        rows = {"epoch": np.zeros(prompts * n, np.int64), "prompt": np.repeat(np.arange(prompts), n)}
        future = self._launch({**rows, "offset": np.tile(np.arange(n), prompts)}, self.val_workload)
        future.result()
        self._spent["testing"] += self.clock.now - start
        record.timing["testing"] = self.clock.now - start

    # -- the simulation's side ---------------------------------------------------------

    def _batch(self, rows: dict[str, np.ndarray], requests: list[Request], seconds: float) -> Batch:
        columns = {
            "prompt_tokens": [r.shape.prompt_tokens for r in requests],
            "response_tokens": [r.response_tokens for r in requests],
            "min_weight_version": [r.version for r in requests],
            "max_weight_version": [r.last_version for r in requests],
            "interruptions": [r.interruptions for r in requests],
        }
        arrays = {**rows, **{key: np.array(value) for key, value in columns.items()}}
        return Batch(non_tensor_batch=arrays, meta_info={GENERATE_S: seconds})

    def _row(self, record: StepRecord, start: float) -> dict[str, float]:
        elapsed = self.clock.now - start
        with self.clock.lock:
            for engine in self.rollout.engines:
                engine.advance()
            busy = sum(engine.busy_s for engine in self.rollout.engines)
        engine_busy, self._busy_before = busy - self._busy_before, busy
        extras = record.batch.non_tensor_batch
        # A schedule's own ratios (trainer/idle_ratio, fully_async/rollouter/idle_ratio) time real
        # seconds; the virtual clock's replace them.
        own = {key: value for key, value in record.metrics.items() if not key.endswith("idle_ratio")}
        return {
            **own,
            "step": record.step,
            "time_s": self.clock.now,
            "timing_s/step": elapsed,
            "timing_s/train": self._spent["train"],
            f"timing_s/{WEIGHT_SYNC}": self._spent["sync"],
            "timing_s/testing": self._spent["testing"],
            "trainer/idle_ratio": max(0.0, elapsed - sum(self._spent.values())) / elapsed if elapsed else 0.0,
            "rollout/busy_ratio": engine_busy / (elapsed * self.engine_count) if elapsed else 0.0,
            "samples": float(len(record.batch)),
            "response_length/mean": float(extras["response_tokens"].mean()),
            "partial_samples": float((extras["interruptions"] > 0).sum()),
        }
