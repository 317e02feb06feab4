"""skip-plugin-fully-async: verl's fully asynchronous schedule (``trainer.schedule=fully_async``)."""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_schedules(register):
    from skip_plugin_fully_async.schedule import FullyAsync

    register("fully_async", FullyAsync.from_config)
