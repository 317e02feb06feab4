"""What a role is, and what the per-call hooks see of one call."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from skip_core.config import RoleConfig
from skip_core.layout import Layout


@dataclass(frozen=True)
class Role:
    """A family of decorated functions driven by one ``skip.<name>`` config section.

    ``online_step``: the step is resolved per call by ``skip_resolve_step`` (e.g. from a
    sample id) instead of the trainer step given to ``SkipManager.set_step``.
    ``config``: the pydantic model of the section; subclass ``RoleConfig`` to add fields or
    actions.
    """

    name: str
    online_step: bool = False
    config: type[RoleConfig] = RoleConfig


@dataclass(frozen=True)
class Hit:
    """A decision to replace a call; ``skip_precondition`` returns it, ``skip_warp`` consumes it.

    ``step`` is the step whose result replaces the call: under ``repeat`` it may differ from
    the step of the call. ``source`` is whatever the warp needs (the cache entry for cache roles).
    """

    step: int
    source: Any = None


@dataclass
class Call:
    """One call of a decorated function, as the hooks see it. ``layout``: what the function
    declared it returns (``SkipManager.annotate(role, layout=...)``), which a replacement must fit."""

    function: Any
    args: tuple
    kwargs: dict
    signature: inspect.Signature | None = field(default=None, repr=False)
    layout: Layout | None = field(default=None, repr=False)

    @cached_property
    def arguments(self) -> dict[str, Any]:
        """Arguments by parameter name (``self`` included for methods)."""
        if self.signature is None:
            return dict(self.kwargs)
        try:
            return dict(self.signature.bind_partial(*self.args, **self.kwargs).arguments)
        except TypeError:
            return dict(self.kwargs)

    @cached_property
    def prompts(self) -> Any:
        """The prompts batch: ``prompts=``, else the first positional argument after ``self``."""
        return prompts_of(self.args, self.kwargs, prompts_position(self.signature))

    @cached_property
    def fingerprint(self) -> str | None:
        """Content hash of the prompts batch, taken before the function runs (it may mutate them)."""
        from skip_core.encoding import fingerprint

        return fingerprint(self.prompts)


def prompts_of(args: tuple, kwargs: dict, position: int) -> Any:
    if "prompts" in kwargs:
        return kwargs["prompts"]
    return args[position] if len(args) > position else None


def prompts_position(signature: inspect.Signature | None) -> int:
    """Where the prompts batch sits among positional arguments: after ``self``/``cls`` for methods."""
    if signature is None:
        return 0
    params = list(signature.parameters)
    return 1 if params and params[0] in ("self", "cls") else 0
