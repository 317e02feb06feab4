"""skip-plugin-trainer: the trainer and rollout runtime behind ``skip run`` and ``skip rollout``.

Everything this distribution adds to skip is registered here; the work lives in ``config/``
(the shipped YAML, the typed sections and the settings validated from them, verl's keys),
``rollout/`` (the agent loop, tools, padding, the rollout workers, the ``skip rollout`` job),
``data/`` (rows, chat format, dataset, loader), ``algorithms/`` (verl's losses and advantage
estimators), ``train/`` (the policy and critic workers, Ray pools, the ``sync`` schedule,
checkpoints, metrics, the trainer), ``diff/`` (``skip diff``) and ``reward.py``. Heavy imports
wait until a command runs.
"""

from __future__ import annotations

from skip_core import hookimpl

from skip_plugin_trainer import hookspecs


@hookimpl
def skip_add_hookspecs(add):
    add(hookspecs)


@hookimpl
def skip_register_sections(register):
    from skip_plugin_trainer.config.settings import SECTIONS

    for key, model in SECTIONS.items():
        register(key, model)


@hookimpl
def skip_register_schedules(register):
    register("sync", _sync)


def _sync(sections):
    from skip_plugin_trainer.train.sync import SyncSchedule

    return SyncSchedule()


@hookimpl
def skip_register_tool_parsers(register):
    from skip_plugin_trainer.rollout.tools import HermesParser

    register("hermes", HermesParser)


@hookimpl
def skip_register_rewards(register):
    from skip_plugin_trainer.reward import score_by_task

    register("task", score_by_task)


@hookimpl
def skip_register_policy_losses(register):
    from skip_plugin_trainer.algorithms.builtin import LOSSES

    for name, loss in LOSSES.items():
        register(name, loss)


@hookimpl
def skip_register_advantage_estimators(register):
    from skip_plugin_trainer.algorithms.advantages import ESTIMATORS

    for estimator in ESTIMATORS:
        register(estimator)


@hookimpl
def skip_register_commands(cli):
    from skip_plugin_trainer import commands

    commands.register(cli)
