"""The trainer-schedule contract: what a schedule may ask of a trainer, and nothing more.

A schedule decides the order of a run's work: when generation starts, when it is waited for,
when weights move. The trainer does the work. ``Run`` is all a schedule sees of it, so
``sync`` (generate, then train, every step) and overlapped schedules (one step off, fully
async) are written against the same few typed operations; ``generate`` returns a future,
so a schedule can train while a generation runs.

Schedules register through ``skip_register_schedules`` and ``trainer.schedule=<name>`` picks one.
Its words are named below: the ``meta_info`` keys the parties share, the phases a step is timed in.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from skip_core import spans

#: ``meta_info`` keys. The trainer step of a generation (verl's name): the trainer writes it, the rollout seeds
#: and names samples by it.
GLOBAL_STEPS = "global_steps"
#: On validation prompts (verl's name), by the trainer: the core's roles let them through, the rollout samples
#: them with its validation settings.
VALIDATE = "validate"
#: On training prompts, by the trainer: one greedy response each, a baseline (ReMax's) rather than samples to
#: train on. The core's roles let them through, as validation's.
GREEDY = "greedy"
#: The batch row of the prompts' first, by a streaming schedule or the trainer: the rollout seeds and names row
#: ``i`` as row ``index_base + i``, however the batch was cut.
INDEX_BASE = "index_base"
#: By ``Run.prompts``: a streaming schedule reads the epoch and the loader's state before the batch (sample ids,
#: resume points), ``Run.generate`` takes the state after it for the step's checkpoint.
EPOCH, LOADER_STATE_BEFORE, LOADER_STATE = "epoch", "loader_state_before", "loader_state"
#: By ``Run.generate`` on its result, the generation's own seconds: a schedule overlapping it may record them.
GENERATE_S = "generate_s"

#: Phases (``timing_s/<phase>``, the span ``trainer/<phase>``). The whole step, which ``Run.step`` times.
STEP = "step"
#: A step's wait for its batch and its weight push (``Run.sync_weights``): the schedule times both, under these
#: names whichever schedule it is.
GEN, WEIGHT_SYNC = "gen", "sync_weights"
#: What ``Run.train`` times, in its order; one the settings leave out (``ref`` without a reference model) is not.
TRAIN_PHASES = ("reward", "old_log_prob", "ref", "teacher", "values", "adv", "update_critic", "update_actor")


@dataclass
class StepRecord:
    """One training step's numbers: seconds per phase (``timing_s/<phase>``) and metrics.

    ``batch`` is the batch the step trained on; the step's data metrics are read from it.
    """

    step: int
    timing: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    batch: Any = None
    #: Set by a schedule whose data position is not the batch it trained (it streams samples):
    #: the prompt loader's state a resumed run starts from, and what else it needs (JSON), both
    #: saved with this step's checkpoint.
    loader_state: dict | None = None
    schedule_state: dict | None = None

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to ``timing[phase]``; the block is also a ``trainer/<phase>`` span."""
        start = time.perf_counter()
        try:
            with spans.span(f"trainer/{phase}", step=self.step):
                yield
        finally:
            self.timing[phase] = self.timing.get(phase, 0.0) + time.perf_counter() - start


class Run(Protocol):
    """What a trainer offers its schedule."""

    #: Prompts per training step (``data.train_batch_size``) and per optimizer step
    #: (``actor.ppo_mini_batch_size``, which divides it): what a streaming schedule gathers per update.
    train_batch_size: int
    ppo_mini_batch_size: int

    def steps(self) -> range:
        """The training steps still to run: after the last checkpoint, up to the run's total."""

    def step(self, step: int) -> AbstractContextManager[StepRecord]:
        """The context of one training step: timed as ``STEP``; on a normal exit a checkpoint is
        saved when due, the record is logged and the step counts as done (a resumed run starts
        after it)."""

    def prompts(self) -> Any:
        """The next batch of training prompts (``meta_info``: ``EPOCH``, ``LOADER_STATE[_BEFORE]``);
        epochs follow each other without a gap."""

    def resume_state(self) -> dict | None:
        """The ``schedule_state`` saved with the checkpoint this run resumed from, if any."""

    def generate(self, prompts: Any, step: int, sample_id: str | None = None) -> Future:
        """Start rolling out ``prompts`` for training step ``step`` with the rollout engines' current
        weights; return at once. The future's result is the batch of prompts and samples (each
        with the ``min_weight_version``/``max_weight_version`` that generated it; ``meta_info``:
        ``GENERATE_S``). Skip roles see ``step`` as its trainer step; with ``sample_id``
        (``sample_{epoch}_{index}``) ``prompts`` is one streamed prompt, the call skip's
        ``async_rollout`` role wraps."""

    def train(self, batch: Any, record: StepRecord) -> None:
        """``TRAIN_PHASES`` on ``batch``, from the reward to the actor update, each timed in ``record``."""

    def sync_weights(self, interrupt: bool = False) -> None:
        """Push the actor's weights to the rollout engines; the generations started afterwards use
        them. ``RuntimeError`` while a generation is in flight, unless ``interrupt``: then the
        engines pause, the requests running continue from their tokens so far with the new
        weights (partial rollout), and each sample records the weight versions it saw."""

    def after_update(self, record: StepRecord, interrupt: bool = False) -> None:
        """Validation of the weights just updated, when its frequency falls on ``record.step``.
        The engines get those weights first: once the generations in flight finish, or, with
        ``interrupt`` (a streaming schedule), at once, those generations continuing with them."""


class Schedule(ABC):
    #: Whether generation overlaps training: samples then come from older weights (the trainer
    #: defaults to using their rollout log-probs as PPO's old log-probs) and the rollout and
    #: actor workers run at the same time (each gets only its own pool's CPUs).
    overlapped: bool = False
    #: Whether it generates prompt by prompt (``Run.generate`` with a ``sample_id``, skip's
    #: ``async_rollout`` role) rather than a batch per step (the ``rollout`` role).
    streams: bool = False
    #: The phases it times itself (``StepRecord.timed``), in the order a step runs them.
    phases: tuple[str, ...] = ()
    #: Phases it records that ran beside the step, not in it (one step off's next generation).
    background: tuple[str, ...] = ()

    @abstractmethod
    def fit(self, run: Run) -> None:
        """Run every step of ``run.steps()``, each inside ``run.step(step)``."""
