"""Role ``async_rollout``: replay single streamed samples by their feed-order index.

Decorate the per-sample entry point (verl: ``generate_sequences_single(self, prompts,
sample_id)``) with ``@SkipManager.annotate(role="async_rollout")``. The step of each call is
the last number of its sample id ``sample_{epoch}_{index}``, read per call, so concurrent
samples never share a step.
"""

import re

import numpy as np
from skip_core import Role, hookimpl

ROLE = Role(name="async_rollout", online_step=True)

SAMPLE_ID = re.compile(r"(?:uid_)?sample_(\d+)_(\d+)")
EXPECTED = "sample_{epoch}_{index} or uid_sample_{epoch}_{index} with non-negative integers"


@hookimpl
def skip_register_roles(register):
    register(ROLE)


@hookimpl
def skip_resolve_step(role, call):
    if role.name != ROLE.name:
        return None
    return feed_index(sample_id_of(call))


def sample_id_of(call) -> str:
    """``sample_id=`` wins; otherwise the single distinct ``uid`` of the prompts batch."""
    explicit = call.arguments.get("sample_id")
    if explicit is not None:
        return explicit
    uids = getattr(call.prompts, "non_tensor_batch", {}).get("uid")
    if uids is None or len(uids) == 0:
        raise ValueError(f"async_rollout: no sample id: pass sample_id= or set non_tensor_batch['uid'] ({EXPECTED})")
    distinct = set(np.asarray(uids, dtype=object).ravel().tolist())
    if len(distinct) != 1:
        raise ValueError(f"async_rollout: one call carries several sample ids {sorted(map(str, distinct))[:4]}")
    return distinct.pop()


def feed_index(sample_id) -> int:
    """The feed-order index of a sample id: ``sample_3_42`` -> 42."""
    match = SAMPLE_ID.fullmatch(sample_id) if isinstance(sample_id, str) else None
    if match is None:
        raise ValueError(f"async_rollout: malformed sample id {sample_id!r}; expected {EXPECTED}")
    return int(match.group(2))
