"""The ``sync`` schedule: verl's colocated loop, one phase after another in every step.

Generation uses the weights of the previous update, so the ratio against old log-probs is
on-policy up to engine numerics. With a skip cache hit, ``gen`` is the time to load the batch.
"""

from __future__ import annotations

from skip_core.schedule import GEN, WEIGHT_SYNC, Run, Schedule


class SyncSchedule(Schedule):
    phases = (GEN, WEIGHT_SYNC)

    def fit(self, run: Run) -> None:
        for step in run.steps():
            with run.step(step) as record:
                prompts = run.prompts()
                with record.timed(GEN):
                    batch = run.generate(prompts, step).result()
                run.train(batch, record)
                with record.timed(WEIGHT_SYNC):
                    run.sync_weights()
                run.after_update(record)
