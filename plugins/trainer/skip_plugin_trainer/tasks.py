"""The task interface: what a run trains on, packaged so a config can name it.

A task owns its data (generated on first use when it can be), an optional model to start
from, and the rule-based score of a response. ``task.name=arithmetic`` is the embedded
default; a user's own task registers through ``skip_register_tasks``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TaskAssets:
    """Paths ``Task.prepare`` guarantees to exist; ``model_path`` is None for data-only tasks."""

    train_files: list[Path]
    val_files: list[Path]
    model_path: Path | None = None


class Task(ABC):
    name: str
    data_sources: tuple[str, ...]

    @abstractmethod
    def prepare(self, directory: Path, options: Any, progress: bool = True) -> TaskAssets:
        """Create whatever is missing under ``directory`` (atomically) and return the paths.

        Idempotent: a second call finds everything in place and returns at once.
        """

    def check_options(self, options: Mapping[str, Any]) -> None:  # noqa: B027 (optional: no options to check)
        """Raise ``ConfigError`` naming ``task.<key>`` for a bad option, before any work starts."""

    @abstractmethod
    def score(self, response: str, ground_truth: str) -> float:
        """Rule-based reward of one decoded response (all assistant turns) against the truth."""
