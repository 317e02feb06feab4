"""skip-plugin-arithmetic: the embedded default -- multi-digit arithmetic with a calculator tool,
and the tiny Llama and tokenizer built and warmed up for it on first use (``task.name=arithmetic``)."""

from __future__ import annotations

from skip_core import hookimpl


@hookimpl
def skip_register_tasks(register):
    from skip_plugin_arithmetic.task import ArithmeticTask

    register(ArithmeticTask())


@hookimpl
def skip_register_tools(register):
    from skip_plugin_arithmetic.calculator import Calculator

    register("calculator", Calculator)
