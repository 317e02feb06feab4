"""Fully asynchronous training: a rollouter streams samples while the trainer updates.

The rollouter feeds one prompt at a time (``rollouter.py``); the trainer takes
``actor.ppo_mini_batch_size x require_batches`` finished samples per update, in the order they
finish, so a long-tail request delays only itself. Every ``trigger_parameter_sync_step``
updates the weights move to the engines. Staleness is bounded: feeding stops once the samples
fed since the last sync reach ``required x (1 + staleness_threshold) x
trigger_parameter_sync_step``. With ``partial_rollout`` a sync pauses the engines and the
requests in flight continue from their tokens so far with the new weights; without it, the
sync waits for them to finish. ``staleness_threshold=0``, ``trigger_parameter_sync_step=1``,
``partial_rollout=false`` trains on exactly what ``sync`` trains on.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, PositiveInt
from skip_core.batch import Batch
from skip_core.schedule import GEN, WEIGHT_SYNC, Run, Schedule, StepRecord

from skip_plugin_fully_async.rollouter import Rollouter


class AsyncTraining(BaseModel):
    """``async_training``, verl's keys. ``require_batches`` null: one train batch per update
    (``data.train_batch_size / actor.ppo_mini_batch_size`` mini-batches)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    staleness_threshold: NonNegativeFloat = 0.1
    trigger_parameter_sync_step: PositiveInt = 4
    require_batches: PositiveInt | None = None
    partial_rollout: bool = True


class FullyAsync(Schedule):
    overlapped = True
    streams = True
    phases = (GEN, WEIGHT_SYNC)

    def __init__(self, settings: AsyncTraining) -> None:
        self.settings = settings
        self._stale_total = 0
        self._param_version = 0  # the step whose weights the engines hold

    def fit(self, run: Run) -> None:
        steps = run.steps()
        if not steps:
            return
        s = self.settings
        # Prompts per update; ppo_mini_batch_size divides train_batch_size (checked with the settings).
        required = run.ppo_mini_batch_size * (s.require_batches or run.train_batch_size // run.ppo_mini_batch_size)
        limit = int(required * (1 + s.staleness_threshold) * s.trigger_parameter_sync_step)
        rollouter = Rollouter(run, limit, len(steps) * required, run.resume_state())
        run.sync_weights()
        self._param_version = steps[0] - 1
        rollouter.start()
        trained = set(rollouter.trained_before)
        since_sync = 0
        try:
            for step in steps:
                with run.step(step) as record:
                    started = time.perf_counter()
                    with record.timed(GEN):  # the trainer's wait for samples
                        samples = rollouter.take(required)
                    batch = self._batch(samples)
                    run.train(batch, record)
                    since_sync = (since_sync + 1) % self.settings.trigger_parameter_sync_step
                    self._sync_and_validate(run, rollouter, record, sync=since_sync == 0)
                    trained.update(index for index, _ in samples)
                    self._record(record, rollouter, batch, started, trained)
        finally:
            rollouter.stop()

    def _batch(self, samples: list[tuple[int, Batch]]) -> Batch:
        """The samples in feed order: the order ``sync`` would train them in."""
        return Batch.concat([sample for _, sample in sorted(samples, key=lambda pair: pair[0])])

    def _sync_and_validate(self, run: Run, rollouter: Rollouter, record: StepRecord, sync: bool) -> None:
        """A due sync, then validation, then the sync's new feeding window: opened before
        validation, its burst of samples would queue ahead of validation's on the engines.
        Validation needs the latest weights there: with partial rollout it pauses the samples
        in flight instead of waiting for them."""
        if sync:
            with record.timed(WEIGHT_SYNC):  # verl's param_sync
                if self.settings.partial_rollout:
                    run.sync_weights(interrupt=True)
                else:
                    rollouter.hold()
                    run.sync_weights()
            self._param_version = record.step
        run.after_update(record, interrupt=self.settings.partial_rollout)
        if sync:
            rollouter.synced()

    def _record(
        self, record: StepRecord, rollouter: Rollouter, batch: Batch, started: float, trained: set[int]
    ) -> None:
        extras = batch.non_tensor_batch
        stale = extras["min_weight_version"] < record.step - 1
        self._stale_total += int(stale.sum())
        partial = extras["interruptions"] > 0
        elapsed = time.perf_counter() - started
        record.metrics.update(
            {
                "fully_async/count/stale_samples_processed": float(self._stale_total),
                "fully_async/count/current_param_version": float(self._param_version),
                "fully_async/partial/total_partial_num": float(partial.sum()),
                "fully_async/partial/partial_ratio": float(partial.mean()),
                "fully_async/partial/max_partial_span": float(
                    np.max(extras["max_weight_version"] - extras["min_weight_version"])
                ),
                "trainer/idle_ratio": record.timing[GEN] / elapsed if elapsed > 0 else 0.0,
                "fully_async/rollouter/idle_ratio": min(1.0, rollouter.idle_seconds() / elapsed)
                if elapsed > 0
                else 0.0,
            }
        )
        record.loader_state, record.schedule_state = rollouter.fed.resume_point(trained)
