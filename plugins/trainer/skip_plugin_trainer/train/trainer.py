"""The main job: a GRPO run on Ray whose work a schedule puts in order (``skip run``).

``Trainer`` checks every setting and input before it starts anything (a bad key fails in a
second, not after the model loaded), then owns the data position, checkpoints and metrics;
Ray and the workers are its ``Cluster`` (``workers.py``), which checkpoint it resumes from is
``resume.py``'s to say. It offers a ``Schedule`` exactly ``skip_core.schedule.Run``: start a
generation (a future), train on a batch, sync weights, validate and checkpoint when due, so
the same trainer runs colocated (``sync``) or overlapped schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ray.exceptions import RayActorError
from rich.console import Console
from skip_core import spans
from skip_core.batch import Batch
from skip_core.loop_thread import LoopThread
from skip_core.manager import SkipManager
from skip_core.schedule import (
    EPOCH,
    GENERATE_S,
    GLOBAL_STEPS,
    GREEDY,
    INDEX_BASE,
    LOADER_STATE,
    LOADER_STATE_BEFORE,
    STEP,
    TRAIN_PHASES,
    VALIDATE,
    Schedule,
    StepRecord,
)

from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.data import collate, generation_inputs
from skip_plugin_trainer.rollout.group import WorkerLost
from skip_plugin_trainer.rollout.parts import RolloutParts, prepare_task
from skip_plugin_trainer.train.checkpoint import CheckpointManager, capture_rng, restore_rng
from skip_plugin_trainer.train.checkpoint_files import Checkpoint
from skip_plugin_trainer.train.dynamic_sampling import fill
from skip_plugin_trainer.train.metrics import data_metrics, engine_metrics, throughput_metrics, timing_metrics
from skip_plugin_trainer.train.phases import Phases
from skip_plugin_trainer.train.preflight import last_step_of, load_data, schedule
from skip_plugin_trainer.train.resume import claimed, nothing_left, restore, shard_writer, stopped, trainer_state
from skip_plugin_trainer.train.summary import plot, summary_table
from skip_plugin_trainer.train.tracking import Tracking, check_loggers
from skip_plugin_trainer.train.train_data import save_train_data
from skip_plugin_trainer.train.train_only import plan_engines
from skip_plugin_trainer.train.workers import Cluster

#: What the trainer times itself beside ``TRAIN_PHASES`` (``Phases.train``), in the order a step
#: runs them: in ``train`` dynamic sampling's extra generations and the engines' sleep (colocated),
#: in ``after_update`` validation, in ``step`` the checkpoint.
FILTER_GROUPS, SLEEP, TESTING, SAVE_CHECKPOINT = "filter_groups", "sleep", "testing", "save_checkpoint"
TRAINER_PHASES = (FILTER_GROUPS, SLEEP, *TRAIN_PHASES, TESTING, SAVE_CHECKPOINT)


def stacked_phases(schedule: Schedule) -> tuple[str, ...]:
    """Every phase a step may spend its time in under ``schedule``, in the order its plot stacks
    them: the schedule's, then the trainer's (``STEP`` is their total; the background is beside)."""
    return (*schedule.phases, *TRAINER_PHASES)


class Trainer:
    """The data position, checkpoints and metrics of one run; a ``Schedule`` orders its work.

    Implements ``skip_core.schedule.Run``: ``steps``, ``step``, ``prompts``, ``generate``,
    ``train``, ``sync_weights`` and ``after_update`` are all a schedule uses.
    """

    def __init__(self, config: Any, console: Console) -> None:
        self.console = console
        self.settings = s = RunSettings.from_config(config)
        check_loggers(s.trainer.logger)
        torch.manual_seed(s.trainer.seed)
        self.schedule: Schedule = schedule(s)
        self.parts = RolloutParts.from_settings(s)
        SkipManager.activate(s.roles, s.namespace, s.setup)
        SkipManager.hold(f"skip run {s.trainer.experiment_name}")  # before any work: a second run stops here
        prepare_task(s)
        self.tokenizer, self.loader, self.val_set, self.rewarder = load_data(s, self.parts)
        self.total_steps = last_step_of(s.trainer, len(self.loader))
        self.train_batch_size, self.ppo_mini_batch_size = s.data.train_batch_size, s.actor.ppo_mini_batch_size
        self.run_dir = Path(os.path.expanduser(s.trainer.default_local_dir))
        self.checkpoints = CheckpointManager(self.run_dir, keep=s.trainer.max_ckpt_to_keep)
        self._claim = contextlib.ExitStack()  # the run directory's lock, until close(), however the run ends
        self.resume_from: Checkpoint | None = self._claim.enter_context(claimed(s, self.checkpoints))
        self.global_steps = 0
        self.cluster = Cluster()
        self.tracking: Tracking | None = None
        # Generations run on their own event loop: a schedule may train meanwhile, and streamed
        # samples (many at once) wait on the rollout workers without a thread each.
        self._generations = LoopThread("skip-generate")
        self._in_flight: set[Future] = set()
        # Weight versions: the step whose update the actor / the rollout engines hold.
        self._actor_version = self._rollout_version = 0
        self._loader_states: dict[int, dict | None] = {}
        self._resumed_schedule_state: dict | None = None
        self._engine_counts: dict[str, float] = {}
        self._loader_lock = threading.Lock()
        spans.configure(s.sections, worker=-1)

    @property
    def finished(self) -> bool:
        """Whether the checkpoint this run would resume from is already at or past its last step."""
        return self.resume_from is not None and self.resume_from.step >= self.total_steps

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Join or start Ray, place the pools, load the model and restore the checkpoint, if any."""
        s = self.settings
        plan = plan_engines(s, self.schedule, self.loader, self.resume_from, self.total_steps, self.val_set is not None)
        if plan.line:
            self.console.print(plan.line, soft_wrap=True)
        self.cluster.start(s, self.schedule.overlapped, self.total_steps, defer_rollout=plan.deferred)
        self.rollout, self.actor, self.critic = self.cluster.rollout, self.cluster.actor, self.cluster.critic
        self.phases = Phases(s, self.actor, self.rewarder, self.schedule.overlapped, self.critic)
        if self.resume_from is not None:
            self._resume(self.resume_from)
        self.tracking = Tracking(
            s.trainer.logger,
            self.run_dir,
            s.dump(),
            project=s.trainer.project_name,
            experiment=s.trainer.experiment_name,
            console=self.console,
            resume_step=self.global_steps,
        )

    def fit(self) -> None:
        """Validation before training when asked, then the schedule's steps under a progress bar."""
        if self.val_set is not None and self.settings.trainer.val_before_train and self.global_steps == 0:
            self.tracking.log(self.validate(), 0)
        self._engine_counts = self.rollout.engine_counters()  # each step logs its engines' work from here
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=False) as self._bar:
            self._bar.add_task("steps", total=self.total_steps, completed=self.global_steps)
            self.schedule.fit(self)

    def close(self) -> None:
        """Wait for generations and cache dumps, stop the workers and free the pools, then let go of
        the run directory; safe after a failed start."""
        try:
            wait(list(self._in_flight))  # a generation still running finishes before its workers go
            self._generations.stop()
            SkipManager.flush()
            if self.tracking is not None:
                self.tracking.close()
            self.cluster.close()
            spans.close()
        finally:
            SkipManager.release()
            self._claim.close()

    # -- what a schedule uses (skip_core.schedule.Run) ------------------------------------

    def steps(self) -> range:
        return range(self.global_steps + 1, self.total_steps + 1)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[StepRecord]:
        record = StepRecord(step)
        SkipManager.set_step(step)
        with record.timed(STEP):
            yield record
            record.metrics.update(self._engine_metrics())
            if self._due(self.settings.trainer.save_freq, step):
                # The line goes out before the checkpoint: a run killed in between resumes after
                # this step and must still have its metrics.
                self.tracking.stage(self._metrics(record), step)
                with record.timed(SAVE_CHECKPOINT):
                    self.save_checkpoint(record)
        if self.settings.trainer.save_train_data and record.batch is not None:
            save_train_data(self.run_dir, step, record.batch)
        self.global_steps = step
        self._loader_states.pop(step, None)
        self.tracking.log(self._metrics(record), step)
        self._bar.advance(self._bar.task_ids[0])

    def _metrics(self, record: StepRecord) -> dict[str, float]:
        """The step's metrics; before the step's time is known (a staged line) without throughput."""
        batch = record.batch
        metrics = {**record.metrics, **self._batch_metrics(batch, record.step), **timing_metrics(record.timing, batch)}
        if STEP in record.timing:
            metrics.update(throughput_metrics(record.timing, batch))
        return metrics

    def _engine_metrics(self) -> dict[str, float]:
        counts = self.rollout.engine_counters()
        metrics = engine_metrics(self._engine_counts, counts)
        self._engine_counts = counts
        return metrics

    def prompts(self) -> Batch:
        """The step's prompts: reading, chat templates and tokenization happen here (``data`` span)."""
        with self._loader_lock, spans.span("trainer/data"):  # fully_async's feeder draws too
            before = self.loader.state_dict()
            batch = next(self.loader)
            after = self.loader.state_dict()
        # A checkpoint records the loader where the batch it trained was drawn, not further on:
        # an overlapped schedule has drawn the next batch already, which a resumed run must see.
        batch.meta_info.update({LOADER_STATE: after, LOADER_STATE_BEFORE: before, EPOCH: before["epoch"]})
        return batch

    def generate(self, prompts: Batch, step: int, sample_id: str | None = None, generation: int = 0) -> Future:
        """Roll out in the background; the result is the prompts joined with their samples
        (verl's pop, repeat, union). Skip roles see ``step`` as the call's trainer step; with
        ``sample_id`` (``sample_{epoch}_{index}``) it is one streamed prompt (``async_rollout``);
        ``generation`` numbers a step's extra generations (dynamic sampling)."""
        state = prompts.meta_info.pop(LOADER_STATE, None)
        for key in (LOADER_STATE_BEFORE, EPOCH):  # bookkeeping, not part of what is generated
            prompts.meta_info.pop(key, None)
        if sample_id is None and generation == 0:
            self._loader_states[step] = state
        future = self._generations.submit(self._generate(prompts, step, sample_id, generation))
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        return future

    async def _generate(self, batch: Batch, step: int, sample_id: str | None, generation: int) -> Batch:
        start = time.perf_counter()
        base = int(batch.meta_info.get(INDEX_BASE, 0))  # a streamed row is seeded as in its whole batch
        gen_batch = generation_inputs(batch)
        gen_batch.meta_info.update({GLOBAL_STEPS: step, INDEX_BASE: base})
        if sample_id is None:
            with SkipManager.step_scope(step), SkipManager.generation_scope(generation):
                output = await asyncio.to_thread(self.rollout.generate_sequences, gen_batch)
        else:
            output = await self.rollout.generate_sequences_single(gen_batch, sample_id)
        if "reward_baselines" in self.settings.estimator().needs:
            batch.batch["reward_baselines"] = await self._greedy_baseline(gen_batch, batch, step, base)
        batch.non_tensor_batch["uid"] = np.array([f"{step}:{base + i}" for i in range(len(batch))], dtype=object)
        batch = batch.repeat(self.settings.rollout.n, interleave=True).union(output)
        batch.meta_info[GENERATE_S] = time.perf_counter() - start
        return batch

    async def _greedy_baseline(self, gen_batch: Batch, prompts: Batch, step: int, base: int) -> torch.Tensor:
        """ReMax's baseline, as verl computes it: each prompt's greedy response from the weights
        that sampled its responses, scored by the reward function, before the prompts are
        repeated. Not cached: skip roles let greedy generations through (``GREEDY``)."""
        greedy = Batch(
            gen_batch.batch, gen_batch.non_tensor_batch, {GLOBAL_STEPS: step, INDEX_BASE: base, GREEDY: True}
        )
        with spans.span("trainer/greedy_baseline", step=step):
            output = await asyncio.to_thread(self.rollout.generate_sequences, greedy)
        scores, _ = self.rewarder(prompts.select().union(output))
        return scores.sum(-1)

    def train(self, batch: Batch, record: StepRecord) -> None:
        if self.settings.algorithm.filter_groups.enable:
            with record.timed(FILTER_GROUPS):  # the extra generations and the rewards they need
                batch, metrics = self._filter_groups(batch, record.step)
            record.metrics.update(metrics)
        record.batch = batch
        # How many updates the weights that generated each sample lag behind the ones it trains.
        stale = self._actor_version - batch.non_tensor_batch["min_weight_version"]
        record.metrics["training/staleness"] = float(stale.mean())
        record.metrics["training/staleness_max"] = float(stale.max())
        if self.settings.resources.colocate:  # the actor gets the device; sync_weights wakes the engines
            with record.timed(SLEEP):
                self.rollout.sleep(keep_weights=False)  # the step's sync overwrites them (verl's level 2)
        self.phases.train(batch, record)
        self._actor_version = record.step

    def _filter_groups(self, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """DAPO's dynamic sampling; an extra generation draws the next prompts and is seeded
        (and its groups named) after the step's earlier generations."""

        def generate(index: int) -> Batch:
            prompts = self.prompts()
            prompts.meta_info[INDEX_BASE] = index * self.settings.generation_batch_size
            batch = self.generate(prompts, step, generation=index).result()
            if step in self._loader_states:  # sync: the step's checkpoint resumes after these prompts
                self._loader_states[step] = self.loader.state_dict()
            return batch

        return fill(
            batch,
            self.settings.algorithm.filter_groups,
            prompts_wanted=self.train_batch_size,
            samples_per_prompt=self.settings.rollout.n,
            score=self.phases.compute_reward,
            generate=generate,
            step=step,
        )

    def sync_weights(self, interrupt: bool = False) -> None:
        if not interrupt and any(not future.done() for future in self._in_flight):
            raise RuntimeError("sync_weights: a generation is in flight; wait for it first")
        asleep = self.rollout.asleep
        if asleep:  # verl's order: the weights' memory back, the new weights into it, then the KV cache
            self.rollout.wake_up("weights")
        self.rollout.update_weights(self.cluster.weights, self._actor_version, interrupt)
        if asleep:
            self.rollout.wake_up("kv_cache")
        self._rollout_version = self._actor_version

    def after_update(self, record: StepRecord, interrupt: bool = False) -> None:
        if self.val_set is not None and self._due(self.settings.trainer.test_freq, record.step):
            with record.timed(TESTING):
                self._catch_up(interrupt)
                record.metrics.update(self.validate(record.step))

    # -- validation, checkpoints, metrics ------------------------------------------------

    def validate(self, step: int = 0) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) rollouts of the validation set; skip roles let them through."""
        batch = collate([self.val_set[i] for i in range(len(self.val_set))])
        gen_batch = generation_inputs(batch)
        gen_batch.meta_info.update({GLOBAL_STEPS: step, VALIDATE: True})
        with spans.span("trainer/validate", step=step, phase="val"):
            output = self.rollout.generate_sequences(gen_batch)
        batch = batch.repeat(self.settings.rollout.val_kwargs.n, interleave=True).union(output)
        _, parts = self.rewarder(batch)
        metrics = {"val/score/mean": float(parts["score"].mean())}
        sources = batch.non_tensor_batch["data_source"]
        for source in sorted(set(sources)):
            metrics[f"val/{source}/score/mean"] = float(parts["score"][sources == source].mean())
        return metrics

    def _catch_up(self, interrupt: bool) -> None:
        """Validation measures the policy just updated: bring the engines up to date, after
        the generations in flight finish (they keep the weights they started with) or, with
        ``interrupt``, at once (they continue with the new weights, as at a partial-rollout sync)."""
        while not interrupt and self._in_flight:  # a streaming schedule may start more until its bound
            for future in list(self._in_flight):
                future.result()
        if self._rollout_version != self._actor_version:
            self.sync_weights(interrupt)

    def _due(self, every: int, step: int) -> bool:
        """Whether a ``*_freq`` event falls on ``step`` (the last step always counts)."""
        return every > 0 and (step % every == 0 or step == self.total_steps)

    def _resume(self, checkpoint: Checkpoint) -> None:
        checkpoint = restore(checkpoint, self.settings, self.checkpoints, self.actor, self.critic)
        self.loader.load_state_dict(checkpoint.trainer["loader"])
        self.global_steps = self._actor_version = checkpoint.step
        self._resumed_schedule_state = checkpoint.trainer.get("schedule")
        self.sync_weights()
        restore_rng(checkpoint.rng)
        self.resume_from = None  # its tensors are the actor's now; the driver need not hold them
        self.console.print(f"resumed at step {self.global_steps} from {checkpoint.path}")

    def save_checkpoint(self, record: StepRecord) -> Path:
        loader = record.loader_state or self._loader_states.get(record.step) or self.loader.state_dict()
        state = trainer_state(self.settings, record.step, loader, record.schedule_state)
        try:
            return self.checkpoints.save(record.step, state, capture_rng(), shard_writer(self.actor, self.critic))
        except OSError as exc:  # a full disk: the save left nothing behind, the earlier checkpoints stand
            path, cause = self.checkpoints.path(record.step), getattr(exc, "cause", exc)  # a rank's: Ray's wraps it
            what = f"cannot save its checkpoint {path}: {cause.strerror or cause}"
            raise stopped(what, record.step, self.checkpoints) from exc

    def resume_state(self) -> dict | None:
        return self._resumed_schedule_state

    def _batch_metrics(self, batch: Batch, step: int) -> dict[str, float]:
        metrics = data_metrics(batch)
        stats = batch.meta_info.get("rollout") or {}
        if "generated_tokens" in stats:
            metrics["rollout/generated_tokens"] = float(stats["generated_tokens"])
            metrics["rollout/tool_calls"] = float(stats["tool_calls"])
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def report(self) -> None:
        """The summary table and the reward / step-time plot, in the run directory."""
        history = self.tracking.history if self.tracking else []
        steps = [row for row in history if row.get("step", 0) > 0]
        if not steps:
            return
        self.console.print(summary_table(steps))
        # With step 0: validation before training.
        chart = plot(history, self.run_dir / "plot.png", stacked_phases(self.schedule), self.schedule.background)
        self.console.print(f"metrics, checkpoints and {chart.name} in {self.run_dir}")


def run(config: Any, console: Console) -> Trainer:
    """The ``skip run`` job: check everything, train, report; workers are freed on any exit."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    trainer = Trainer(config, console)
    if trainer.finished:
        trainer.close()
        console.print(nothing_left(trainer.resume_from, trainer.total_steps), soft_wrap=True)
        return trainer
    console.print(
        f"training {trainer.total_steps} steps: {trainer.settings.train_batch_size} prompts x "
        f"{trainer.settings.rollout.n} samples per step, schedule {trainer.settings.trainer.schedule}, "
        f"run directory {trainer.run_dir}"
    )
    try:
        trainer.start()
        # Once placed: a placement Ray refuses ends in its one line, not after a table.
        for line in [*trainer.settings.placement().lines(), trainer.settings.weight_sync().line()]:
            console.print(line, soft_wrap=True, markup=False)  # which GPU holds what; how weights travel
        trainer.fit()
    except (RayActorError, WorkerLost) as exc:  # a rollout worker Ray restarts is survived below this
        what = str(exc) if isinstance(exc, WorkerLost) else trainer.cluster.describe(exc)
        raise stopped(what, trainer.global_steps + 1, trainer.checkpoints) from exc
    finally:
        trainer.close()
    trainer.report()
    return trainer
