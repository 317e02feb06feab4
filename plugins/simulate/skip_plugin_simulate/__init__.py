"""skip-plugin-simulate: the installed schedules against a simulated trainer, ``skip simulate``.

A schedule sees nothing of a trainer but ``skip_core.schedule.Run``, so the schedule plugins
run unchanged against a ``Run`` in virtual time: no model, no Ray, cluster scale on a laptop.
"""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_commands(cli):
    from skip_plugin_simulate.cli import register

    register(cli)
