"""One step off policy: batch k+1 is generated while batch k trains.

The rollout and actor pools are disjoint, so generation and training really run at the same
time; the step then costs about max(generation, training) instead of their sum. Weights move
exactly once per step, between two generations: after waiting for the batch about to be
trained and before starting the next one. Batch k is therefore generated with the weights of
step k-2, always exactly one update stale (the rollout log-probs stand in as PPO's old
log-probs by default, ``algorithm.rollout_correction.bypass_mode``).

Timing: ``gen`` is the wait for the batch (the part of its generation that was not overlapped),
``generate_async`` (verl's name) the generation's own time in the background, ``sync_weights``
the weight push (verl's ``sync_rollout_weights``).
"""

from __future__ import annotations

from skip_core.schedule import GEN, GENERATE_S, WEIGHT_SYNC, Run, Schedule

#: The generation of the batch a step trains, timed on the rollout pool while the step before trained.
GENERATE_ASYNC = "generate_async"


class OneStepOff(Schedule):
    overlapped = True
    phases = (GEN, WEIGHT_SYNC)
    background = (GENERATE_ASYNC,)

    def fit(self, run: Run) -> None:
        steps = run.steps()
        if not steps:
            return
        run.sync_weights()  # a resumed run's engines get the checkpoint's weights before batch 1
        pending = run.generate(run.prompts(), steps[0])
        for step in steps:
            with run.step(step) as record:
                with record.timed(GEN):
                    batch = pending.result()
                record.timing[GENERATE_ASYNC] = batch.meta_info[GENERATE_S]
                with record.timed(WEIGHT_SYNC):
                    run.sync_weights()
                if step < steps[-1]:
                    pending = run.generate(run.prompts(), step + 1)
                run.train(batch, record)
                run.after_update(record)
