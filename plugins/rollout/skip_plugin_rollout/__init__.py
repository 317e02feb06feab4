"""Role ``rollout``: replay the rollouts of chosen trainer steps.

Decorate the batch generation entry point (verl: ``AgentLoopManager.generate_sequences``)
with ``@SkipManager.annotate(role="rollout")`` and call ``SkipManager.set_step`` each step.
The cache and repeat actions come from core's default implementation of the hooks.
"""

from skip_core import Role, hookimpl

ROLE = Role(name="rollout")


@hookimpl
def skip_register_roles(register):
    register(ROLE)
