"""Which enabled roles verl's trainer reaches: a role it never calls is said once, never ignored in silence.

verl's trainers differ in what they call: the V1 trainer never calls what ``skip.rollout``
serves, the legacy one never calls ``annotate_tq``, a streaming reward never calls
``_compute_reward_colocate``, a run without a critic never computes values. Each served call
marks its role; when a trainer step ends (``set_step`` of the next) with a listed step of an
enabled role that nothing marked, a warning names the role and where its work happens instead.
"""

from __future__ import annotations

import warnings

# Where the work of a role goes when verl does not call what the role serves.
HINTS = {
    "rollout": "verl's V1 trainer (trainer.use_v1=true, its default) caches rollouts with skip.rollout_tq",
    "rollout_tq": "only verl's V1 trainer calls it; the legacy trainer (trainer.use_v1=false) uses skip.rollout",
    "reward": "a streaming reward is computed in the agent loop and cached with the rollouts; the legacy "
    "trainer's reward is not served",
}

_reached: set[str] = set()
_told: set[str] = set()


def reset() -> None:
    _reached.clear()
    _told.clear()


def reached(role: str) -> None:
    _reached.add(role)


def check(step: int) -> None:
    """Step ``step - 1`` has ended: warn once for each enabled trainer-step role it listed and nothing reached."""
    from skip_core import SkipManager

    for name in SkipManager.stores():
        role, config, _ = SkipManager.active(name)
        if role.online_step or name in _reached or name in _told or step - 1 not in config.steps:
            continue
        _told.add(name)
        hint = HINTS.get(name, "verl's trainer does not run that phase in this configuration")
        warnings.warn(
            f"skip.{name}: verl's trainer ended step {step - 1} without calling what this role serves, "
            f"so nothing is cached or replayed for it ({hint})",
            UserWarning,
            stacklevel=3,
        )
