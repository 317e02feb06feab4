"""The trainer schedule interface: how generation and training steps are ordered.

Schedules register through ``skip_register_schedules`` and are chosen with
``trainer.schedule=<name>``: ``sync`` (colocated, in core), and plugins such as
one-step-off that overlap generation with training.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Schedule(ABC):
    @abstractmethod
    def fit(self, trainer: Any) -> None:
        """Run steps ``trainer.global_steps + 1 .. trainer.total_steps`` with the trainer's phases.

        Calls ``SkipManager.set_step(step)`` before each step's generation, so skip roles see
        the step a batch trains at.
        """
