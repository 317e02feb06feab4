"""The replay protocol, once for every caller: the decorated functions' manager and the plugins
that drive a role themselves (verl's phases and its TransferQueue rollout).

``look_up`` asks ``skip_precondition`` whether a call is replaced, timed as a ``skip_lookup``
span that says hit or miss; ``load`` has ``skip_warp`` produce the result, timed as a
``skip_load`` span, and turns an entry that does not load, or a warp that fails, into a
``CacheWarning`` and a miss: a replacement that goes wrong never loses a step, the call runs.
A third-party plugin that implements either hook sees every caller's calls."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from skip_core import spans
from skip_core.config import RoleConfig
from skip_core.entries import CorruptEntry
from skip_core.plugins import pm
from skip_core.roles import Call, Hit, Role
from skip_core.store import CacheStore, CacheWarning


def look_up(
    role: Role,
    config: RoleConfig,
    store: CacheStore,
    step: int,
    call: Call,
    complete: Callable[[Hit], bool] | None = None,
    **fields: Any,
) -> Hit | None:
    """The ``Hit`` that replaces ``call`` at ``step``, or ``None`` to run it. ``complete``: what
    else the caller needs of a hit (every part of a step cached), a miss when it says no;
    ``fields`` go on the span (``generation=1``)."""
    with spans.span("skip_lookup", role=role.name, **fields) as span:
        hit = pm.hook.skip_precondition(role=role, config=config, store=store, step=step, call=call)
        if hit is not None and complete is not None and not complete(hit):
            hit = None
        span.set(cache="miss" if hit is None else "hit")
    return hit


def load(
    role: Role, config: RoleConfig, store: CacheStore, step: int, hit: Hit, call: Call, instead: str = "running it"
) -> Any | None:
    """What ``skip_warp`` makes of ``hit``, or ``None`` (a miss) when it declines, when the entry
    does not load or when the warp fails, the last two said in a ``CacheWarning`` that ends with
    ``instead`` (what the caller does then: ``generating it``)."""
    try:
        with spans.span("skip_load", role=role.name, source_step=hit.step):
            return pm.hook.skip_warp(role=role, config=config, store=store, hit=hit, call=call)
    except CorruptEntry as exc:
        where = exc.path or getattr(hit.source, "path", hit.source)
        why = f"ignoring cache entry {where}: {exc}"
    except Exception as exc:  # a plugin's warp: the call still runs
        why = f"replacing the call from step {hit.step} failed ({exc!r})"
    warnings.warn(f"skip.{role.name} step {step}: {why}; {instead} instead", CacheWarning, stacklevel=3)
    return None


def replay(
    role: Role, config: RoleConfig, store: CacheStore, step: int, call: Call, instead: str = "running it"
) -> Any | None:
    """The result that replaces ``call`` at ``step``, or ``None`` to run it: ``look_up`` then ``load``."""
    hit = look_up(role, config, store, step, call)
    return None if hit is None else load(role, config, store, step, hit, call, instead)
