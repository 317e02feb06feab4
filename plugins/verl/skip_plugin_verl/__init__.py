"""skip-plugin-verl: skip and verl side by side; today ``skip cache import-verl`` converts verl's
pickled rollout dumps into verified skip entries (reading a pickle only with ``--trust-pickle``)."""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_commands(cli):
    from skip_plugin_verl import commands

    commands.register(cli)
