"""Plugin loading: core's default plugins plus installed distributions of the ``skip`` group.

``SKIP_PLUGINS=dist-a,dist-b`` restricts which installed distributions load; an empty
string loads none. Default plugins (inside core) always load.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from skip_core import hookspecs

DEFAULT_PLUGINS = (
    "skip_core.caching",
    "skip_core.tools",
    "skip_core.calculator",
    "skip_core.arithmetic",
    "skip_core.reward",
    "skip_core.sync",
)

pm = pluggy.PluginManager("skip")
pm.add_hookspecs(hookspecs)

# plugin name -> (distribution, version); default plugins map to skip-core.
_distributions: dict[str, tuple[str, str]] = {}
_loaded = False


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_plugins() -> pluggy.PluginManager:
    """Load plugins once per process; later calls return the same manager."""
    global _loaded
    if _loaded:
        return pm
    _loaded = True
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
        _distributions[name] = ("skip-core", _version("skip-core"))
    allowed = os.environ.get("SKIP_PLUGINS")
    wanted = None if allowed is None else {_normalize(d) for d in allowed.split(",") if d}
    for ep in entry_points(group="skip"):
        dist = ep.dist.name if ep.dist else ep.name
        if wanted is not None and _normalize(dist) not in wanted:
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:
            warnings.warn(
                f"skip: plugin distribution {dist!r} failed to load and is skipped: {exc!r}",
                stacklevel=2,
            )
            continue
        _distributions[ep.name] = (dist, ep.dist.version if ep.dist else "?")
    return pm


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


@dataclass
class Registry:
    """What the loaded plugins registered, and which plugin registered each name."""

    roles: dict[str, Any] = field(default_factory=dict)
    backends: dict[str, Callable] = field(default_factory=dict)
    schedules: dict[str, Callable] = field(default_factory=dict)
    tools: dict[str, Callable] = field(default_factory=dict)
    tool_parsers: dict[str, Callable] = field(default_factory=dict)
    tasks: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, Callable] = field(default_factory=dict)
    provider: dict[tuple[str, str], str] = field(default_factory=dict)


def registry() -> Registry:
    """Call every registration hook, attributing each registered name to its plugin."""
    load_plugins()
    reg = Registry()
    for kind, hook in (
        ("roles", pm.hook.skip_register_roles),
        ("backends", pm.hook.skip_register_backends),
        ("schedules", pm.hook.skip_register_schedules),
        ("tools", pm.hook.skip_register_tools),
        ("tool_parsers", pm.hook.skip_register_tool_parsers),
        ("tasks", pm.hook.skip_register_tasks),
        ("rewards", pm.hook.skip_register_rewards),
    ):
        for impl in hook.get_hookimpls():
            impl.function(register=_registrar(reg, kind, impl.plugin_name))
    return reg


def _registrar(reg: Registry, kind: str, plugin: str) -> Callable:
    table = getattr(reg, kind)

    def register(item: Any, factory: Callable | None = None) -> None:
        name = item.name if factory is None else item
        if name in table:
            other = distribution(reg.provider[(kind, name)])
            raise ValueError(f"{kind[:-1]} {name!r} is registered by both {other} and {distribution(plugin)}")
        table[name] = item if factory is None else factory
        reg.provider[(kind, name)] = plugin

    return register


def distribution(plugin: str) -> str:
    return _distributions.get(plugin, (plugin, "?"))[0]


def installed() -> list[tuple[str, str, str, Registry]]:
    """(plugin name, distribution, version, what it registered) for each loaded plugin."""
    reg = registry()
    rows = []
    for name, _ in pm.list_name_plugin():
        dist, version = _distributions.get(name, (name, "?"))
        mine = Registry()
        for (kind, item), owner in reg.provider.items():
            if owner == name:
                getattr(mine, kind)[item] = getattr(reg, kind)[item]
        rows.append((name, dist, version, mine))
    return rows


def _reset_for_tests() -> None:
    """Unregister everything so a test can reload with a different ``SKIP_PLUGINS``."""
    global _loaded
    for name, plugin in list(pm.list_name_plugin()):
        pm.unregister(plugin, name=name)
    _distributions.clear()
    _loaded = False
