"""The ``sync`` schedule: verl's colocated loop, one phase after another in every step.

Generation uses the weights of the previous update, so the ratio against old log-probs is
on-policy up to engine numerics. ``timing_s/<phase>`` of every phase lands in the step's
metrics; with a skip cache hit, ``gen`` is the time to load the batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from skip_core import spans
from skip_core.manager import SkipManager
from skip_core.schedule import Schedule


@contextlib.contextmanager
def timed(name: str, timing: dict[str, float], **context: Any) -> Iterator[None]:
    """Add the block's seconds to ``timing[name]``; it is also a ``trainer/<name>`` span."""
    start = time.perf_counter()
    try:
        with spans.span(f"trainer/{name}", **context):
            yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


class SyncSchedule(Schedule):
    def fit(self, trainer: Any) -> None:
        if trainer.val_set is not None and trainer.settings.trainer.val_before_train and trainer.global_steps == 0:
            trainer.log(trainer.validate(), 0)
        with trainer.progress() as advance:
            while trainer.global_steps < trainer.total_steps:
                self.step(trainer)
                advance()

    def step(self, trainer: Any) -> None:
        from skip_plugin_trainer.train.metrics import throughput_metrics, timing_metrics  # torch: not at `skip` startup

        step = trainer.global_steps + 1
        SkipManager.set_step(step)
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timed("step", timing, step=step):
            batch = trainer.next_batch()
            with timed("gen", timing):
                batch = trainer.generate(batch, step)
            with timed("reward", timing):
                trainer.compute_reward(batch)
            with timed("old_log_prob", timing):
                metrics.update(trainer.compute_old_log_prob(batch))
            if trainer.settings.use_reference:
                with timed("ref", timing):
                    trainer.compute_ref_log_prob(batch)
            with timed("adv", timing):
                metrics.update(trainer.compute_advantage(batch))
            with timed("update_actor", timing):
                metrics.update(trainer.update_actor(batch))
            with timed("update_weights", timing):
                trainer.sync_weights()
            trainer.global_steps = step
            if trainer.val_set is not None and trainer.due(trainer.settings.trainer.test_freq):
                with timed("testing", timing):
                    metrics.update(trainer.validate())
            if trainer.due(trainer.settings.trainer.save_freq):
                with timed("save_checkpoint", timing):
                    trainer.save_checkpoint()
        metrics.update(trainer.step_metrics(batch))
        metrics.update(timing_metrics(timing, batch))
        metrics.update(throughput_metrics(timing, batch))
        trainer.log(metrics, step)
