"""Role ``values``: replay the critic's values on chosen trainer steps.

Decorate the function whose result the role caches with
``@SkipManager.annotate(role="values")`` and call ``SkipManager.set_step`` each
trainer step. The function must return a ``skip_core.Batch``. The ``cache`` and
``repeat`` actions come from core's default implementation of the per-call hooks.
"""

from skip_core import Role, hookimpl

ROLE = Role(name="values")


@hookimpl
def skip_register_roles(register):
    register(ROLE)
