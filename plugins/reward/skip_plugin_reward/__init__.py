"""Role ``reward``: replay the scores of the responses on chosen trainer steps, never for other responses.

Decorate the function whose result the role caches with
``@SkipManager.annotate(role="reward")`` and call ``SkipManager.set_step`` each
trainer step. The function must return a ``skip_core.Batch``. The ``cache`` and
``repeat`` actions come from core's default implementation of the per-call hooks.

A score belongs to its response: the entry's input fingerprint covers the responses as well
as the prompts, and a hit whose responses differ is scored again (``regenerate``) or fails
(``error``). Loading it anyway with a warning, which other roles allow, is refused here.
"""

from typing import Literal

from skip_core import Role, RoleConfig, hookimpl


class RewardRoleConfig(RoleConfig):
    on_prompt_mismatch: Literal["regenerate", "error"] = "regenerate"


ROLE = Role(name="reward", config=RewardRoleConfig)


@hookimpl
def skip_register_roles(register):
    register(ROLE)
