"""The hooks of the trainer and rollout runtime, added to skip's by this plugin (``skip_add_hookspecs``).

They are the runtime's own extension points: only code running the agent loop, a dataset or
rewards calls them, so core does not know them.
"""

from __future__ import annotations

from skip_core.hookspecs import hookspec


@hookspec
def skip_register_tools(register):
    """Register agent-loop tools: call ``register(name, factory)``.

    ``factory(config: dict) -> skip_plugin_trainer.rollout.tools.Tool`` builds the tool from
    its entry in the tools YAML (``rollout.multi_turn.tools_config``); a sample uses the tools
    named in its ``extra_info.tools_kwargs``.
    """


@hookspec
def skip_register_tool_parsers(register):
    """Register parsers of tool calls in model output: call ``register(name, factory)``.

    ``factory() -> skip_plugin_trainer.rollout.tools.ToolParser``;
    ``rollout.multi_turn.format=<name>`` selects one (this plugin registers ``hermes``).
    """


@hookspec
def skip_register_tasks(register):
    """Register tasks: call ``register(task)`` with a ``skip_plugin_trainer.tasks.Task``.

    ``task.name=<name>`` selects one; it provides data, optionally a model, and the score.
    """


@hookspec
def skip_register_rewards(register):
    """Register rule-based reward functions: call ``register(name, fn)``.

    ``fn(data_source, solution_str, ground_truth, extra_info) -> float`` scores one decoded
    response (verl's ``compute_score`` signature); ``reward.function=<name>`` selects one.
    This plugin registers ``task``, which dispatches on ``data_source`` to the registered task.
    """


@hookspec
def skip_register_policy_losses(register):
    """Register policy losses: call ``register(name, loss)``.

    ``loss(inputs, ctx) -> PolicyLoss`` (``skip_plugin_trainer.algorithms.contract``) computes one
    micro-batch's loss and metrics; ``actor.policy_loss.loss_mode=<name>`` selects one. This
    plugin registers verl 0.9.1's twelve, by verl's names.
    """


@hookspec
def skip_register_advantage_estimators(register):
    """Register advantage estimators: call ``register(estimator)`` with an
    ``skip_plugin_trainer.algorithms.contract.Estimator``.

    ``algorithm.adv_estimator=<name>`` selects one; its ``needs`` name the inputs the trainer
    provides it (``values``: a critic is trained). This plugin registers verl 0.9.1's fourteen.
    """
