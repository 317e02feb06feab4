"""``Located``: a Ray actor that can say where it runs, so that the warning or the error about
losing it names the process and the node (a dead actor can no longer be asked)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray


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
