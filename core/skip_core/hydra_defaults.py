"""Hydra defaults for every installed role and declared config section, so that an override
names exactly the keys the models accept: ``skip.<role>.<key>=...`` and
``rollout.engine_kwargs.vllm.max_num_seqs=16`` need no ``+``, and a key no model has is refused.

Hydra is not a dependency of skip-core (``pip install skip-core[hydra]``); verl's and skip's
own Hydra apps have it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from skip_core.config import MISSING, RoleConfig
from skip_core.plugins import registry


def hydra_defaults(roles: Mapping[str, type[RoleConfig]], sections: Mapping[str, type[BaseModel]]) -> dict:
    """Default ``skip`` section for the given roles and the defaults of every section, for a Hydra ConfigStore node."""
    node: dict[str, Any] = {"skip": {name: defaults(model) for name, model in sorted(roles.items())}}
    for key, model in sorted(sections.items()):  # a section before those nested in it
        *path, name = key.split(".")
        parent = node
        for part in path:
            parent = parent.setdefault(part, {})
        parent[name] = {**defaults(model), **parent.get(name, {})}
    return node


def defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Every key of ``model`` with its default as plain data; ``???`` (mandatory) where there is none."""
    values = {}
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        if field.is_required():
            values[name] = MISSING
        else:
            default = field.get_default(call_default_factory=True)
            values[name] = TypeAdapter(field.annotation).dump_python(default, mode="json")
    return values


def register_hydra_defaults(name: str = "skip_defaults") -> None:
    """Store the defaults of every installed role and declared section as the Hydra config ``name``.

    Add ``- skip_defaults`` to a primary config's ``defaults`` list, before ``_self_``: the
    config's own values then override these, and command-line overrides of any key a model
    declares (``skip.rollout.steps=[1,2,3]``, ``async_training.staleness_threshold=0.5``) work
    without a ``+`` prefix.
    """
    from hydra.core.config_store import ConfigStore

    reg = registry()
    node = hydra_defaults({name: role.config for name, role in reg.roles.items()}, reg.sections)
    ConfigStore.instance().store(name=name, node=node)
