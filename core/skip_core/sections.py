"""Config sections that plugins declare, validated once at the start of a run and handed down typed.

A plugin declares a section through ``skip_register_sections``: ``register("async_training",
AsyncTraining)``, a dotted key and the pydantic model of what may stand there, as llm's model
plugins declare their ``Options`` (a rollout ``Backend`` declares its own). ``parse_sections``
validates every declared section of a run config in one pass, with core's one-line errors; a
plugin then reads ``sections[AsyncTraining]`` and never the raw config. The same models give
Hydra its defaults (``skip_core.hydra_defaults``), so the keys a command-line override may name
and the keys a model accepts are one list.

A section may sit inside another (``rollout.hf`` inside the trainer's ``rollout``): each model
sees only its own keys, and a mapping between them (``rollout.engine_kwargs``) may hold only
declared sections. ``parse_roles`` validates the ``skip`` section, one ``skip.<role>`` per
installed role.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from skip_core.config import (
    PLUGIN_FOLDERS,
    ConfigError,
    RoleConfig,
    install_hint,
    is_hydra_marker,
    parse_section,
    select,
    to_container,
    unknown_key,
)

M = TypeVar("M", bound=BaseModel)


class Sections:
    """The validated sections of one run config: ``sections[Model]`` is that model's section.

    ``Sections(HFOptions(device="cpu"), ...)`` builds one by hand, for a test or a benchmark.
    """

    def __init__(self, *values: BaseModel) -> None:
        self._by_model = {type(value): value for value in values}

    def __getitem__(self, model: type[M]) -> M:
        try:
            return self._by_model[model]
        except KeyError:
            declared = ", ".join(sorted(kind.__name__ for kind in self._by_model)) or "none"
            raise KeyError(f"no config section of model {model.__name__} is declared (declared: {declared})") from None


def parse_sections(config: Any, declared: Mapping[str, type[BaseModel]]) -> Sections:
    """Validate every declared section of ``config`` (missing ones take their defaults).

    ``ConfigError`` names the first bad key, what is allowed there and the closest match; a
    section that a plugin of this repository declares, turned on (``enable: true``) while that
    plugin is not installed, says which distribution to install.
    """
    models = {}
    for key, model in declared.items():
        if model in models:
            raise ConfigError(f"{key}: model {model.__name__} is declared for both {models[model]} and {key}")
        models[model] = key
    known = set(declared) | {name for kind, name in PLUGIN_FOLDERS if kind == "section"}
    _check_nests(config, declared, known)
    _check_not_installed(config, known - set(declared))
    return Sections(*(_parse(config, key, model, known) for key, model in declared.items()))


def _parse(config: Any, key: str, model: type[BaseModel], known: set[str]) -> BaseModel:
    """The section at ``key``, without the sections nested in it, which their own models validate."""
    raw = to_container(select(config, key))
    nested = _children(key, known)
    if isinstance(raw, Mapping):
        raw = {name: value for name, value in raw.items() if name not in nested}
    return parse_section(model, key, raw, nested)


def _children(key: str, keys: set[str]) -> set[str]:
    """The first names below ``key`` on the way to each of ``keys`` under it."""
    return {other[len(key) + 1 :].split(".")[0] for other in keys if other.startswith(f"{key}.")}


def _check_nests(config: Any, declared: Mapping[str, type[BaseModel]], known: set[str]) -> None:
    """A mapping between a declared section and one nested in it holds nothing but sections."""
    for key in declared:
        parts = key.split(".")
        for depth in range(2, len(parts)):
            nest = ".".join(parts[:depth])
            if ".".join(parts[: depth - 1]) not in declared or nest in known:
                continue
            raw = to_container(select(config, nest)) or {}
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{nest}: expected a mapping of sections, got {raw!r}")
            for name in raw:
                if f"{nest}.{name}" not in known:
                    raise ConfigError(f"{nest}.{name}: {unknown_key(f'{nest}.{name}', _children(nest, known))}")


def _check_not_installed(config: Any, missing: set[str]) -> None:
    for key in sorted(missing):
        if select(config, f"{key}.enable") is True:
            raise ConfigError(
                f"{key}.enable is true but no installed plugin declares {key}: {install_hint('section', key)}"
            )


def parse_roles(section: Any, installed: Mapping[str, Any] | None = None, strict: bool = True) -> dict[str, RoleConfig]:
    """The ``skip`` section validated: every installed role's ``skip.<role>`` (its defaults where
    absent). A role that is not installed is an error when enabled, saying what to install; a
    disabled one may stand there if this repository ships it (verl's own config lists some) or,
    not ``strict`` (verl's ``SkipManager.init``: a verl of its own may add roles), whatever it is."""
    if installed is None:
        from skip_core.plugins import registry

        installed = registry().roles
    raw = to_container(section) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"skip: expected a mapping of role sections, got {raw!r}")
    for name, value in raw.items():
        if not is_hydra_marker(name) and name not in installed:
            _require_installed(str(name), value, installed, strict)
    return {name: parse_section(role.config, f"skip.{name}", raw.get(name)) for name, role in installed.items()}


def _require_installed(name: str, raw: Any, installed: Mapping[str, Any], strict: bool) -> None:
    hint = install_hint("role", name)
    enabled = isinstance(raw, Mapping) and str(raw.get("enable", False)).lower() in ("true", "1", "yes", "on")
    if hint and enabled:
        raise ConfigError(f"skip.{name}.enable is true but role {name!r} is not installed: {hint}")
    if not hint and (enabled or strict):
        have = ", ".join(sorted(installed)) or "none"
        raise ConfigError(f"skip.{name}: no installed plugin provides role {name!r} (installed roles: {have})")
