"""The driver's side of a weight sync over a process group (``rollout.weight_sync``, ``weight_sync.py``).

The group is the actor's rank 0 and every engine process (``skip_core.weight_group``), formed
before the first sync and again after the workers change (one started late, one restarted):
a worker that joins between syncs is given the weights through the object store, then joins the
group at the next sync. A sync is one call per party, all at once: the actor's ranks gather each
bucket and rank 0 broadcasts it, the engines receive and load it as it comes. A worker lost during
one ends the run, in one line naming it: the broadcast it was part of cannot go on without it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError
from skip_core.weight_group import Layout, Receiver, WeightGroup

log = logging.getLogger(__name__)
TIMEOUT_S = 600.0  # a collective of the group waits this long for its other ranks
LOST_WITHIN_S = 30  # after a sync fails, how long a lost worker may take to be seen as lost


class Members(Protocol):
    """The rollout workers, as ``RolloutGroup`` holds them: ``membership`` changes with them."""

    workers: list[Any]
    membership: int

    def each(self, method: str, what: str) -> dict[int, Any]: ...

    def lost(self, rank: int, what: str, cause: str) -> Exception: ...


class Source(Protocol):
    """The actor's published weights (``train.model_group.WeightSource``)."""

    actor: Any
    layouts: list[Layout]
    version: int


class GroupSync:
    """``backend``: the group's, gloo or nccl."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.dtype: str | None = None  # the engines', which the buckets are cast to
        self._formed_for: int | None = None  # the workers' membership when the group was formed
        self.formed = 0  # groups formed so far
        self._run = uuid.uuid4().hex[:8]

    def sync(self, group: Members, source: Source, interrupt: bool) -> None:
        if self._formed_for != group.membership:
            self._form(group, source)
        layouts: list[Layout] = [tuple(spec._replace(dtype=self.dtype) for spec in layout) for layout in source.layouts]
        sending = source.actor.submit("send_weights", self.dtype)
        receiving = {
            rank: worker.receive_weights.remote(layouts, source.version, interrupt)
            for rank, worker in enumerate(group.workers)
        }
        self._settle(group, sending, receiving, "during a weight sync over the process group")

    def _form(self, group: Members, source: Source) -> None:
        receivers: Mapping[int, Receiver] = group.each("receiver", "while saying how it takes weights")
        dtypes = {receiver.dtype for receiver in receivers.values()}
        if len(dtypes) != 1:
            raise RuntimeError(f"the rollout engines compute in different dtypes ({', '.join(sorted(dtypes))})")
        self.dtype = dtypes.pop()
        world_size = 1 + sum(receiver.ranks for receiver in receivers.values())
        address, port = source.actor.call("host_weight_group", world_size, TIMEOUT_S)[0]
        self.formed += 1
        name = f"skip-weights-{self._run}-{self.formed}"  # torch takes a group's name once per process
        spec = WeightGroup(address, port, world_size, self.backend, name, TIMEOUT_S)
        joining, offset = {}, 1
        for rank, worker in enumerate(group.workers):
            joining[rank] = worker.join_weight_group.remote(spec, offset)
            offset += receivers[rank].ranks
        self._formed_for = None  # until every rank has joined
        self._settle(group, source.actor.submit("join_weight_group", spec), joining, "while joining the weight group")
        self._formed_for = group.membership
        log.info(
            "weight group %s: %d engine processes and the actor's rank 0 over %s at %s:%d, buckets in %s",
            spec.name, world_size - 1, self.backend, address, port, self.dtype,
        )  # fmt: skip

    def _settle(self, group: Members, sending: list[Any], receiving: dict[int, Any], what: str) -> None:
        """Wait for every party; a failure fails the sync, naming a worker lost meanwhile if there is one."""
        pending = [*sending, *receiving.values()]
        while pending:  # the first failure at once: the others may wait for the party that failed
            (ref,), pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ref)
            except Exception as error:
                self._formed_for = None  # its ranks may be gone or stuck: form it again
                settled, _ = ray.wait(list(receiving.values()), num_returns=len(receiving), timeout=LOST_WITHIN_S)
                for rank, worker_ref in receiving.items():
                    if worker_ref in settled and _died(worker_ref):  # named, not the broadcast it broke
                        cause = "its process died, and the broadcast cannot go on without it"
                        raise group.lost(rank, what, cause) from error
                raise


def _died(ref: Any) -> bool:
    """Whether the worker of a settled call died (its own error leaves it alive)."""
    try:
        ray.get(ref)
    except RayActorError:
        return True
    except Exception:
        return False
    return False
