"""The ``cache`` and ``repeat`` actions: core's default implementations of the per-call hooks.

Loaded for every process as a default plugin, so role plugins only declare their role (and,
for online steps, how to read the step from a call). The implementations are ``trylast``:
a plugin can take over any role by answering first.
"""

from __future__ import annotations

import warnings

from skip_core.hookspecs import hookimpl
from skip_core.roles import Hit

CACHE_ACTIONS = ("cache", "repeat")


class PromptMismatchError(RuntimeError):
    """A cached result was generated from other inputs and the policy is ``error``."""


class PromptMismatchWarning(UserWarning):
    """A cached result was generated from other inputs and loaded anyway (policy ``warn``)."""


@hookimpl(trylast=True)
def skip_precondition(role, config, store, step, call):
    if config.action not in CACHE_ACTIONS:
        return None
    fingerprint = call.fingerprint  # taken now: the function may mutate its inputs
    if config.action == "repeat":
        entry = store.nearest(step)
        return None if entry is None else Hit(entry.step, entry)
    entry = store.entry(step)
    if entry is None:
        return None
    mismatch = None not in (entry.fingerprint, fingerprint) and entry.fingerprint != fingerprint
    if mismatch and not _accept_mismatch(role.name, config.on_prompt_mismatch, entry):
        return None
    return Hit(entry.step, entry)


def _accept_mismatch(role: str, policy: str, entry) -> bool:
    what = (
        f"skip.{role} step {entry.step}: the cached result in {entry.path} was generated from "
        f"different inputs than this call's (skip.{role}.on_prompt_mismatch={policy})"
    )
    if policy == "error":
        raise PromptMismatchError(what)
    if policy == "warn":
        warnings.warn(f"{what}; loading it anyway", PromptMismatchWarning, stacklevel=4)
        return True
    return False  # regenerate: run the function; its dump replaces the entry


@hookimpl(trylast=True)
def skip_warp(config, store, hit):
    if config.action not in CACHE_ACTIONS:
        return None
    return store.load(hit.source)


@hookimpl(trylast=True)
def skip_dump(role, config, store, step, call, result):
    if config.action not in CACHE_ACTIONS:
        return
    if not hasattr(result, "non_tensor_batch"):
        raise TypeError(f"skip.{role.name}: cannot cache a result of type {type(result).__name__} (expected a Batch)")
    store.save(step, result, fingerprint=call.fingerprint)
