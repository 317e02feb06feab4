"""The rollout backend interface: an async, per-request generation engine.

Backends register through ``skip_register_backends`` and are chosen with
``rollout.backend=<name>``. The agent loop drives them one request at a time; a backend
batches concurrent requests itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """One completion: token ids, the log-prob of each sampled token, and why it ended."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: Literal["length", "stop", "abort"]
    extra: Mapping[str, Any] = field(default_factory=dict)


class RolloutBackend(ABC):
    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> Generation:
        """Generate one completion of ``prompt_ids``."""

    @abstractmethod
    async def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Load new policy weights from the trainer, in place."""

    @abstractmethod
    async def sleep(self) -> None:
        """Release accelerator memory between rollouts (a no-op where nothing is held)."""

    @abstractmethod
    async def wake_up(self) -> None:
        """Re-acquire what ``sleep`` released."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and free its resources."""
