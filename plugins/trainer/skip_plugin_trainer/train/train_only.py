"""Train-only: a run whose every generation will come from the skip cache starts no rollout engine.

Before any worker is placed, the trainer draws each remaining step's prompts from a copy of its
loader and asks the ``rollout`` role whether that step's call would be replaced
(``SkipManager.would_replace``: the entry present, verified, generated from the same inputs).
If every one would, the rollout workers are not spawned (no engine start, no accelerator memory
held); a generation that reaches them after all, an entry deleted or corrupted meanwhile,
starts them then (``RolloutGroup``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from skip_core.manager import SkipManager
from skip_core.schedule import Schedule

from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.data import PromptLoader, generation_inputs
from skip_plugin_trainer.rollout.padding import ROLLOUT_LAYOUT
from skip_plugin_trainer.train.checkpoint_files import Checkpoint


@dataclass(frozen=True)
class EnginePlan:
    """Whether the rollout engines wait for the first generation the cache cannot serve, and
    the line the run says about it at start (none for a run the cache does not fully cover)."""

    deferred: bool
    line: str | None = None


def plan_engines(
    settings: RunSettings,
    schedule: Schedule,
    loader: PromptLoader,
    resume_from: Checkpoint | None,
    total_steps: int,
    validates: bool,
) -> EnginePlan:
    """The plan for a run from ``resume_from`` (or the start) to ``total_steps``; ``loader`` is
    the run's, read from a copy put where the run will resume."""
    store = SkipManager.stores().get("rollout")
    # A streaming schedule generates per sample (async_rollout), and dynamic sampling draws extra
    # prompts whose number only the rewards tell: neither can be known to be cached ahead.
    if store is None or schedule.streams or settings.algorithm.filter_groups.enable:
        return EnginePlan(False)
    loader, first = copy.copy(loader), 1
    if resume_from is not None:
        loader.load_state_dict(resume_from.trainer["loader"])
        first = resume_from.step + 1
    steps = range(first, total_steps + 1)
    for step in steps:
        if not SkipManager.would_replace("rollout", step, generation_inputs(next(loader)), layout=ROLLOUT_LAYOUT):
            return EnginePlan(False)
    covered = f"every generation of steps {first}-{total_steps} is in the skip cache ({store.directory})"
    if validates:
        return EnginePlan(
            False,
            f"{covered}, but validation generates (trainer.test_freq={settings.trainer.test_freq}); "
            "with trainer.test_freq=0 the run would start no rollout engine",
        )
    return EnginePlan(True, f"train-only: {covered}; no rollout engine is started")
