"""A Ray cluster of two real nodes on this one machine, for the two-node tests and the weight-sync
benchmark: a head (``node_a``) and a worker node (``node_b``), each ``ray start --block`` in its
own mount namespace with a tmpfs over ``/dev/shm`` (its object store) and over its temp directory
(its session, sockets and logs), joined over loopback. Objects then move between the nodes as
between machines. A driver joins with ``nsenter`` into the head's namespace.

Giving a process its own mount namespace needs CAP_SYS_ADMIN (CI runs as root).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
START_TIMEOUT_S = 120


# The head counts a node dead after 3 missed health checks a second apart (Ray's default: 5, 3 s
# apart), so a test that loses one waits seconds, not tens of seconds, to see it gone.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def node_env(address: str | None = None) -> dict[str, str]:
    """Token authentication would need the token on both nodes and the driver; the cluster is this
    machine's."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", **HEALTH_CHECKS, **({"RAY_ADDRESS": address} if address else {})}


def namespaces_refused() -> str | None:
    """Why this machine cannot give each node a mount namespace, or None."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare and nsenter (util-linux) are not installed"
    done = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"unshare --mount is refused here: {done.stderr.strip()}"


@contextmanager
def two_nodes(
    directory: Path, cpus: int = 1, object_store_bytes: int = 500_000_000, shm: str = "2g"
) -> Iterator[tuple[int, str]]:
    """The head's pid (for ``nsenter --mount=/proc/PID/ns/mnt``) and the cluster's address."""
    address = f"127.0.0.1:{_free_port()}"
    sizes = (cpus, object_store_bytes, shm)
    head = _node(directory, "a", *sizes, "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false",
                 "--resources=" + json.dumps({"node_a": 1}))  # fmt: skip
    nodes = [head]
    try:
        _wait_for(head, directory / "a.log")
        nodes.append(_node(directory, "b", *sizes, f"--address={address}", "--resources=" + json.dumps({"node_b": 1})))
        _wait_for(nodes[1], directory / "b.log")
        yield head.pid, address
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=60)


@contextmanager
def another_node(
    directory: Path, address: str, name: str, cpus: int = 1, object_store_bytes: int = 500_000_000, shm: str = "2g"
) -> Iterator[subprocess.Popen]:
    """One more worker node, offering the resource ``name``; ``lose`` it to take it away as a
    failed machine goes: every process of it killed at once."""
    node = _node(directory, name, cpus, object_store_bytes, shm, f"--address={address}",
                 "--resources=" + json.dumps({name: 1}))  # fmt: skip
    try:
        _wait_for(node, directory / f"{name}.log")
        yield node
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=60)


def lose(node: subprocess.Popen) -> None:
    """SIGKILL to the node's raylet, object store, agents and workers (its process group)."""
    os.killpg(node.pid, signal.SIGKILL)
    node.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node(directory: Path, name: str, cpus: int, store: int, shm: str, *args: str) -> subprocess.Popen:
    private = directory / name
    private.mkdir(parents=True)
    script = (
        f"mount -t tmpfs -o size={shm} tmpfs /dev/shm && mount -t tmpfs tmpfs {private} && exec {RAY} start "
        f"--block --temp-dir={private} --num-cpus={cpus} --object-store-memory={store} --disable-usage-stats "
        f"{shlex.join(args)}"
    )
    log = (directory / f"{name}.log").open("w")
    command = ["unshare", "--mount", "--propagation", "private", "bash", "-c", script]
    # A session of its own: the node's processes are one group, which ``lose`` kills together.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=node_env(), start_new_session=True)


def _wait_for(node: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a Ray node did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
