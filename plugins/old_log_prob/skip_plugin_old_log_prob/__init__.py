"""Role ``old_log_prob``: replay the policy's recomputed log-probs and entropies on chosen trainer steps.

Decorate the function whose result the role caches with
``@SkipManager.annotate(role="old_log_prob")`` and call ``SkipManager.set_step`` each
trainer step. The function must return a ``skip_core.Batch``. The ``cache`` and
``repeat`` actions come from core's default implementation of the per-call hooks.
"""

from skip_core import Role, hookimpl

ROLE = Role(name="old_log_prob")


@hookimpl
def skip_register_roles(register):
    register(ROLE)
