"""Hydra defaults for every installed role, so ``skip.<role>.<key>=...`` overrides need no ``+``.

Hydra is not a dependency of skip-core (``pip install skip-core[hydra]``); verl's and skip's
own Hydra apps have it.
"""

from __future__ import annotations

from collections.abc import Mapping

from skip_core.config import RoleConfig
from skip_core.plugins import registry


def hydra_defaults(roles: Mapping[str, type[RoleConfig]]) -> dict:
    """Default ``skip`` section for the given roles, for a Hydra ConfigStore node."""
    return {"skip": {name: model().model_dump() for name, model in sorted(roles.items())}}


def register_hydra_defaults(name: str = "skip_defaults") -> None:
    """Store ``skip`` defaults of every installed role as the Hydra config ``name``.

    Add ``- skip_defaults`` to a primary config's ``defaults`` list, and command-line
    overrides such as ``skip.rollout.enable=True skip.rollout.steps=[1,2,3]`` work without
    a ``+`` prefix for every installed role.
    """
    from hydra.core.config_store import ConfigStore

    node = hydra_defaults({name: role.config for name, role in registry().roles.items()})
    ConfigStore.instance().store(name=name, node=node)
