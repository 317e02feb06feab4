"""``Located``: a Ray actor that can say where it runs, so that the warning or the error about
losing it names the process and the node (a dead actor can no longer be asked)."""

from __future__ import annotations

import os

import ray


class Located:
    def where(self) -> str:
        """This process and its node: the address, and Ray's id, as nodes may share an address."""
        node = ray.get_runtime_context().get_node_id()[:8]
        return f"pid {os.getpid()} on node {ray.util.get_node_ip_address()} ({node})"
