"""skip-plugin-profiling: span logs of every request, turn and event, and ``skip profile``.

Capture needs no change to user code: core opens spans (``skip_core.spans``) and this plugin
returns the sink that writes them when ``profiling.enable`` is true.
"""

from __future__ import annotations

import os

from skip_core import hookimpl

from skip_plugin_profiling.config import ProfilingConfig


@hookimpl
def skip_register_sections(register):
    register("profiling", ProfilingConfig)


@hookimpl
def skip_span_sinks(sections, worker):
    settings = sections[ProfilingConfig]
    if not settings.enable:
        return None
    from skip_plugin_profiling.recorder import Recorder

    return Recorder(os.path.expanduser(settings.dir), worker, settings.steps, settings.flush_interval_s)


@hookimpl
def skip_register_commands(cli):
    from skip_plugin_profiling.cli import register

    register(cli)
