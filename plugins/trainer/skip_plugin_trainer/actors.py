"""What the run's Ray actors share: ``Located``, an actor that can say where it runs, so that the
warning or the error about losing it names the process and the node (a dead actor can no longer
be asked); and ``settle``, the results of calls to several actors, failing at the first that fails."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import ray
from skip_core.progress import progress

#: How often a shown wait looks again, so that its plain lines come even while nothing finishes.
POLL_S = 1.0


@dataclass(frozen=True)
class Where:
    """A process and its node: the address, and Ray's id, as nodes may share an address."""

    pid: int
    address: str
    node_id: str

    def __str__(self) -> str:
        return f"pid {self.pid} on node {self.address} ({self.node_id[:8]})"

    def node_alive(self) -> bool:
        """Whether Ray still counts the node among the living (a lost node no longer is)."""
        return any(node["NodeID"] == self.node_id and node["Alive"] for node in ray.nodes())


class Located:
    def where(self) -> Where:
        return Where(os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())


def settle(refs: Sequence[Any], shown: str | None = None, unit: str = "workers") -> list[Any]:
    """The results of ``refs`` in order, failing as soon as any fails (not after the others,
    which may wait on the failed one forever). With ``shown``, a label (``starting the rollout
    engines``), the wait shows its progress: a long one (a 7B model's load) is never silent."""
    pending, results = list(refs), {}
    with progress(len(refs), shown, unit) if shown else nullcontext(lambda count=1: None) as advance:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S if shown else None)
            for ref in done:
                results[ref] = ray.get(ref)
            advance(len(done))
    return [results[ref] for ref in refs]
