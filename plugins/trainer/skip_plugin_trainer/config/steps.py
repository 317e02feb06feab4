"""``steps``: which steps of ``skip run`` a ``skip rollout`` generates (``steps=1..20``), parsed
into a ``StepSet`` with errors naming the item as written."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError
from skip_core.config import ConfigError, Steps, StepSet, to_container


def job_steps(raw: Any) -> StepSet:
    """``steps``: which steps of ``skip run`` ``skip rollout`` generates, each once and in order.
    Kept as ranges: ``1..1000000000000`` is two numbers, which a check against the run's last step
    refuses before anything would hold a million million of them."""
    if raw is None:
        return StepSet([(1, 1)])
    value = to_container(raw)
    try:
        steps = TypeAdapter(Steps).validate_python(value)
    except ValidationError as exc:
        raise ConfigError(_steps_error(exc, value)) from None
    except ValueError as exc:  # not pydantic's: its words as they are
        raise ConfigError(f"steps: {exc}") from None
    if not steps or steps.ranges[0][0] < 1:
        raise ConfigError(f"steps: expected steps of skip run, which start at 1, got {_shown(value)}")
    return steps


def _steps_error(exc: ValidationError, value: Any) -> str:
    """pydantic's first complaint about ``steps`` as one line naming the item."""
    error = exc.errors()[0]
    key = _step_key(value, error["loc"])
    if error["type"] == "value_error":  # _parse_steps's own words: "the range '5..1' is empty: ..."
        return f"{key}: {error['ctx']['error']}"
    if error["type"] in ("greater_than_equal", "greater_than"):
        return f"{key}: expected steps of skip run, which start at 1, got {_shown(error['input'])}"
    return f"{key}: {_a_step(value)}, got {_shown(error['input'])}"


def _step_key(value: Any, loc: tuple) -> str:
    """``steps``, or ``steps[1]`` for an item of a list (a lone value is validated as a list of one)."""
    items = "".join(f"[{part}]" for part in loc if isinstance(part, int))
    return f"steps{items}" if isinstance(value, list) else "steps"


def _a_step(value: Any) -> str:
    if isinstance(value, list):
        return "expected a step (an integer from 1) or a range like 1..20"
    return "expected a step (an integer from 1), a range like 1..20 or a list of them"


def _shown(value: Any, most: int = 60) -> str:
    """``repr(value)``, cut short: an error line is no place for a pasted file."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 3]}..."
