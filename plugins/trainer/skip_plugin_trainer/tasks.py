"""The task interface: what a run trains on, packaged so a config can name it.

A task owns its data (generated on first use when it can be), an optional model to start
from, and the rule-based score of a response. ``task.name=arithmetic`` is the embedded
default; a user's own task registers through ``skip_register_tasks``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict

from skip_plugin_trainer.config.sections import TaskConfig


@dataclass(frozen=True)
class TaskAssets:
    """Paths ``Task.prepare`` guarantees to exist; ``model_path`` is None for data-only tasks."""

    train_files: list[Path]
    val_files: list[Path]
    model_path: Path | None = None


class NoOptions(TaskConfig):
    """The ``task`` section of a task without options: ``name`` and ``dir`` only."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(ABC):
    name: str
    data_sources: tuple[str, ...]
    #: The ``task`` section of this task: a ``TaskConfig`` subclass declaring its options,
    #: validated once at start with every other section (``extra="forbid"``, so a typo fails).
    Options: ClassVar[type[TaskConfig]] = NoOptions
    #: What ``score`` takes as ground truth: ``reward.function=task`` refuses a row holding anything
    #: else before step 1 (also in ``skip run --check``), naming the row.
    ground_truth_types: ClassVar[tuple[type, ...]] = (str,)

    @abstractmethod
    def prepare(self, directory: Path, options: TaskConfig, progress: bool = True) -> TaskAssets:
        """Create whatever is missing under ``directory`` (atomically) and return the paths.

        ``options`` is an instance of ``Options``. Idempotent: a second call finds everything
        in place and returns at once.
        """

    @abstractmethod
    def score(self, response: str, ground_truth: str) -> float:
        """Rule-based reward of one decoded response (all assistant turns) against the truth."""
