"""Plugin loading: core's default hook implementations plus installed distributions of the ``skip`` group.

``SKIP_PLUGINS=dist-a,dist-b`` restricts which installed distributions load; an empty
string loads none. Core's own defaults (the ``cache``/``repeat`` actions) always load.

Registration hooks are every hook named ``skip_register_<kind>(register)``: core's own
(roles, backends, schedules) and those a plugin adds with ``skip_add_hookspecs`` (the
trainer adds tools, tool parsers, tasks and rewards). ``registry()`` calls them all once per
set of registered plugins and remembers which plugin registered each name.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points, version
from typing import Any

import pluggy

from skip_core import caching, hookspecs
from skip_core.errors import SkipError

pm = pluggy.PluginManager("skip")
pm.add_hookspecs(hookspecs)

REGISTER = "skip_register_"
# plugin name -> (distribution, version)
_distributions: dict[str, tuple[str, str]] = {}
_loaded = False
# (the plugins it was computed from, the registry): computed again when they change
_computed: tuple[list[tuple[str, Any]], Registry] | None = None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_plugins() -> pluggy.PluginManager:
    """Load plugins once per process; later calls return the same manager."""
    global _loaded
    if _loaded:
        return pm
    _loaded = True
    pm.register(caching, name="skip_core.caching")
    _distributions["skip_core.caching"] = ("skip-core", version("skip-core"))
    # Historic: a plugin registered later still gets to add its hook specs.
    pm.hook.skip_add_hookspecs.call_historic(kwargs={"add": _add_hookspecs})
    for ep in entry_points(group="skip"):
        dist = ep.dist.name if ep.dist else ep.name
        if not allowed(dist) or pm.has_plugin(ep.name):
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:
            warnings.warn(f"skip: plugin distribution {dist!r} failed to load and is skipped: {exc!r}", stacklevel=2)
            continue
        _distributions[ep.name] = (dist, ep.dist.version if ep.dist else "?")
    return pm


def allowed(distribution: str) -> bool:
    """Whether ``SKIP_PLUGINS`` lets this installed distribution load (unset: every one does)."""
    wanted = os.environ.get("SKIP_PLUGINS")
    return wanted is None or _normalize(distribution) in {_normalize(d) for d in wanted.split(",") if d}


def _add_hookspecs(module: Any) -> None:
    """``pm.add_hookspecs``, once per module: plugins load again after ``_reset_for_tests``."""
    names = [name for name in dir(module) if name.startswith("skip_")]
    if any(getattr(getattr(pm.hook, name, None), "spec", None) is None for name in names):
        pm.add_hookspecs(module)


class PluginConflict(SkipError):
    """Two installed plugins register the same name (a role, a config section, a backend ...)."""


class Registry:
    """What the loaded plugins registered, by kind (``registry().roles``, ``.tools`` ...), and who registered it."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, Any]] = {}
        self.provider: dict[tuple[str, str], str] = {}
        self.conflicts: list[str] = []  # one line each; the first registration of a name is kept

    def __getattr__(self, kind: str) -> dict[str, Any]:
        if kind.startswith("_") or kind not in self.kinds:
            raise AttributeError(f"no registration kind {kind!r} (kinds: {', '.join(sorted(self.kinds)) or 'none'})")
        return self.kinds[kind]


def registry(strict: bool = True) -> Registry:
    """What every registration hook registers, attributing each name to its plugin; computed once
    while the registered plugins stay the same (shared: read it, never change it). Two plugins
    registering one name raise ``PluginConflict`` naming both and how to choose; ``strict=False``
    returns the registry with the first of them kept (``skip plugins`` lists it, then fails)."""
    global _computed
    load_plugins()
    plugins = pm.list_name_plugin()
    if _computed is None or not _same(plugins, _computed[0]):
        _computed = (plugins, _collect())
    reg = _computed[1]
    if strict and reg.conflicts:
        raise PluginConflict(
            reg.conflicts[0] + (f" (and {len(reg.conflicts) - 1} more)" if len(reg.conflicts) > 1 else "")
        )
    return reg


def _same(plugins: list[tuple[str, Any]], before: list[tuple[str, Any]]) -> bool:
    # By identity (``before`` holds its plugins, so no id is reused): a fresh plugin object counts.
    return [(n, id(p)) for n, p in plugins] == [(n, id(p)) for n, p in before]


def _collect() -> Registry:
    reg = Registry()
    for hook_name in sorted(vars(pm.hook)):
        hook = getattr(pm.hook, hook_name)
        if not hook_name.startswith(REGISTER) or hook.spec is None or "register" not in hook.spec.argnames:
            continue
        kind = hook_name[len(REGISTER) :]
        reg.kinds.setdefault(kind, {})
        for impl in hook.get_hookimpls():
            impl.function(register=_registrar(reg, kind, impl.plugin_name))
    return reg


def _singular(kind: str) -> str:
    """``policy_losses`` -> ``policy loss``, ``backends`` -> ``backend``."""
    return kind.replace("_", " ").removesuffix("es" if kind.endswith("sses") else "s")


def _registrar(reg: Registry, kind: str, plugin: str) -> Callable:
    table = reg.kinds.setdefault(kind, {})

    def register(item: Any, factory: Callable | None = None) -> None:
        name = item.name if factory is None else item
        if name in table:
            first, second = distribution(reg.provider[(kind, name)]), distribution(plugin)
            reg.conflicts.append(
                f"{_singular(kind)} {name!r} is registered by both {first} and {second}; choose one by naming the "
                f"distributions to load: SKIP_PLUGINS={_all_but(second)} (or uninstall one of them)"
            )
            return
        table[name] = item if factory is None else factory
        reg.provider[(kind, name)] = plugin
        if kind == "backends" and item.section is not None:  # a backend declares its options' section
            _registrar(reg, "sections", plugin)(item.section, item.Options)

    return register


def _all_but(unwanted: str) -> str:
    """The loaded distributions other than ``unwanted`` and core (which always loads), for ``SKIP_PLUGINS``."""
    names = dict.fromkeys(dist for dist, _ in _distributions.values() if dist not in (unwanted, "skip-core"))
    return ",".join(names)


def distribution(plugin: str) -> str:
    return _distributions.get(plugin, (plugin, "?"))[0]


def installed() -> list[tuple[str, str, str, dict[str, list[str]]]]:
    """(plugin name, distribution, version, {kind: names it registered}) for each loaded plugin."""
    reg = registry(strict=False)
    rows = []
    for name, _ in pm.list_name_plugin():
        dist, ver = _distributions.get(name, (name, "?"))
        mine: dict[str, list[str]] = {}
        for (kind, item), owner in reg.provider.items():
            if owner == name:
                mine.setdefault(kind, []).append(item)
        rows.append((name, dist, ver, mine))
    return rows


def _reset_for_tests() -> None:
    """Unregister everything so a test can reload with a different ``SKIP_PLUGINS``."""
    global _loaded
    for name, plugin in list(pm.list_name_plugin()):
        pm.unregister(plugin, name=name)
    _distributions.clear()
    _loaded = False
