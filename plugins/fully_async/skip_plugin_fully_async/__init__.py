"""skip-plugin-fully-async: verl's fully asynchronous schedule (``trainer.schedule=fully_async``)."""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_sections(register):
    from skip_plugin_fully_async.schedule import AsyncTraining

    register("async_training", AsyncTraining)


@hookimpl
def skip_register_schedules(register):
    from skip_plugin_fully_async.schedule import AsyncTraining, FullyAsync

    register("fully_async", lambda sections: FullyAsync(sections[AsyncTraining]))
