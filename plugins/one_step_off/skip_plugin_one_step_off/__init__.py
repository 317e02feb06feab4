"""skip-plugin-one-step-off: verl's one-step-off-policy schedule (``trainer.schedule=one_step_off``)."""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_schedules(register):
    from skip_plugin_one_step_off.schedule import OneStepOff

    register("one_step_off", lambda sections: OneStepOff())
