"""The skip hooks of skip-plugin-verl: the role ``rollout_tq``, the ``import-verl`` command, and
replayed results as verl's type."""

from __future__ import annotations

import sys

from skip_core import Role, hookimpl
from skip_core.caching import CACHE_ACTIONS

# The V1 trainer's TransferQueue role (``rollout_tq.py``, imported with verl only: the ``skip``
# command registers roles and must stay light).
ROLE = Role(name="rollout_tq")


@hookimpl
def skip_register_roles(register):
    register(ROLE)


@hookimpl
def skip_register_commands(cli):
    from skip_plugin_verl.dumps import commands

    commands.register(cli)


@hookimpl(tryfirst=True)
def skip_warp(config, store, hit, call):
    """A call of verl's (its prompts are a ``DataProto``) gets a ``DataProto`` back, as its body returns."""
    if "verl.protocol" not in sys.modules:  # no DataProto anywhere: skip's own trainer
        return None
    from skip_plugin_verl.bridge import dataproto_class, to_dataproto

    cls = dataproto_class(call.prompts)
    if cls is None or config.action not in CACHE_ACTIONS:
        return None
    return to_dataproto(store.load(hit.source), cls)
