"""One request of the agent loop: a conversation's tokens, masks and log-probs as it is rolled out,
and the state it is in (PENDING -> RUNNING -> (TOOL_CALLING -> RUNNING)* -> COMPLETED | FAILED)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skip_core.backend import FinishReason


class State(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass
class Request:
    """One conversation being rolled out; the unit of the state machine."""

    batch_index: int
    offset: int
    prompt_ids: list[int]
    messages: list[dict]
    tools_kwargs: Mapping[str, Mapping[str, Any]]
    seed: int | None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: State = State.PENDING
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    user_turns: int = 0  # rounds of tool responses
    tool_calls: int = 0
    # The weight version of every engine call, and how often a pause cut one short.
    weight_versions: list[int] = field(default_factory=list)
    interruptions: int = 0
    tool_rewards: dict[str, float] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def extend(self, ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Append model tokens (with log-probs, mask 1) or environment tokens (mask 0)."""
        self.response_ids.extend(ids)
        self.response_mask.extend([0 if log_probs is None else 1] * len(ids))
        self.log_probs.extend([0.0] * len(ids) if log_probs is None else log_probs)
