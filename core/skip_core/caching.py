"""The ``cache`` and ``repeat`` actions: core's default implementations of the per-call hooks.

Loaded for every process as a default plugin, so role plugins only declare their role (and,
for online steps, how to read the step from a call). The implementations are ``trylast``:
a plugin can take over any role by answering first.

A hit is an entry that verifies, fits what the call returns (``skip_core.layout``), and was
generated from this call's inputs and under this run's setup (``skip_core.provenance``); an
entry that differs in its inputs or its setup is handled by ``skip.<role>.on_prompt_mismatch``
and ``on_setup_mismatch``.
"""

from __future__ import annotations

import warnings

from skip_core.errors import SkipError
from skip_core.hookspecs import hookimpl
from skip_core.provenance import differences
from skip_core.roles import Hit

CACHE_ACTIONS = ("cache", "repeat")


class PromptMismatchError(SkipError, RuntimeError):
    """A cached result was generated from other inputs and the policy is ``error``."""


class PromptMismatchWarning(UserWarning):
    """A cached result was generated from other inputs and loaded anyway (policy ``warn``)."""


class SetupMismatchError(SkipError, RuntimeError):
    """A cached result was generated under another setup and the policy is ``error``."""


class SetupMismatchWarning(UserWarning):
    """A cached result was generated under another setup and loaded anyway (policy ``warn``)."""


@hookimpl(trylast=True)
def skip_precondition(role, config, store, step, call):
    if config.action not in CACHE_ACTIONS:
        return None
    fingerprint = call.fingerprint  # taken now: the function may mutate its inputs
    expected = call.layout.expect(call.prompts, store.namespace) if call.layout is not None else None
    if config.action == "repeat":
        entry = store.nearest(step, expected)
    else:
        entry = store.entry(step, expected)
        if entry is None:
            return None
        mismatch = None not in (entry.fingerprint, fingerprint) and entry.fingerprint != fingerprint
        if mismatch and not _accept_mismatch(role.name, config.on_prompt_mismatch, entry):
            return None
    if entry is None:
        return None
    setup = store.setup.values if store.setup is not None else {}
    differ = differences(entry.meta.get("setup"), setup)
    if differ and not _accept_setup(role.name, config.on_setup_mismatch, entry, differ, store.setup):
        return None
    return Hit(entry.step, entry)


def _accept_mismatch(role: str, policy: str, entry) -> bool:
    what = (
        f"skip.{role} step {entry.step}: the cached result in {entry.path} was generated from "
        f"different inputs than this call's (skip.{role}.on_prompt_mismatch={policy})"
    )
    if policy == "error":
        raise PromptMismatchError(f"{what}; regenerate or warn to go on, or remove the entry")
    if policy == "warn":
        warnings.warn(f"{what}; loading it anyway", PromptMismatchWarning, stacklevel=4)
        return True
    return False  # regenerate: run the function; its dump replaces the entry


def _accept_setup(role: str, policy: str, entry, differ: list[str], setup) -> bool:
    what = (
        f"skip.{role} step {entry.step}: the cached result in {entry.path} was generated under another "
        f"setup: {', '.join(differ)} (skip.{role}.on_setup_mismatch={policy})"
    )
    if policy == "error":
        raise SetupMismatchError(
            f"{what}; set it to warn to replay it anyway, regenerate to generate it again, or use another dump_dir"
        )
    if policy == "regenerate":
        return False  # run the function; its dump replaces the entry
    # Once per role and difference: a replayed run would otherwise repeat it every step.
    if setup is None or setup.first(role, tuple(differ)):
        warnings.warn(
            f"{what}; loading it anyway (later entries with the same difference load without another warning)",
            SetupMismatchWarning,
            stacklevel=4,
        )
    return True


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
