"""``skip run`` on a Ray cluster of two real nodes: a head and a worker node on this machine, each
in its own mount namespace with a private ``/dev/shm`` (its object store) and temp directory
(its session, sockets and logs), joined over the network. Nothing is shared by accident: objects
move between the nodes as between machines. The rollout pool asks for ``node_b``, which only
the worker node offers, and the actor pool for ``node_a``. The run, cache and profile directories
lie under the test's directory, which both nodes see, as on NFS. The driver runs on the head.

Giving a process its own mount namespace needs CAP_SYS_ADMIN (CI runs as root); without it the
tests skip and say so.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from ray_nodes import namespaces_refused, node_env, two_nodes
from training import metrics, overrides

SKIP = Path(sys.executable).parent / "skip"
PLACED = ("resources.rollout.ray_resources={node_b:1}", "resources.actor.ray_resources={node_a:1}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = namespaces_refused()
    if why is not None:
        pytest.skip(f"two Ray nodes need a mount namespace each: {why}")
    with two_nodes(tmp_path_factory.mktemp("nodes")) as nodes:
        yield nodes


def skip_run(cluster, task_dir, tmp_path, *more) -> str:
    """``RAY_ADDRESS=... skip run`` on the head node, the rollout pool on the worker node."""
    head, address = cluster
    command = ["nsenter", f"--mount=/proc/{head}/ns/mnt", str(SKIP), "run", *overrides(task_dir, tmp_path, *more)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=node_env(address))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


RUN = ("trainer.total_training_steps=2", "trainer.test_freq=0", *PLACED)


def test_sync_with_caching_and_profiling_across_two_nodes(cluster, task_dir, tmp_path):
    profile = ("profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}", "skip.rollout.enable=true")
    skip_run(cluster, task_dir, tmp_path, *RUN, *profile)
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "profile" / "step_1").iterdir()) == ["worker_-1.jsonl", "worker_0.jsonl"]
    (shape,) = (tmp_path / "cache").glob("*/GBS*")
    assert sorted(p.name for p in shape.iterdir() if p.name.isdigit()) == ["1", "2"]


def test_one_step_off_across_two_nodes(cluster, task_dir, tmp_path):
    skip_run(cluster, task_dir, tmp_path, *RUN, "trainer.schedule=one_step_off")
    assert [row["training/staleness"] for row in metrics(tmp_path / "run")] == [0.0, 1.0]


def test_fully_async_on_vllm_across_two_nodes(cluster, task_dir, tmp_path):
    cached = (
        "skip.async_rollout.enable=true",
        "skip.async_rollout.steps=1..16",
        "rollout.engine_kwargs.vllm.enforce_eager=true",
    )
    skip_run(cluster, task_dir, tmp_path, *RUN, "trainer.schedule=fully_async", "rollout.backend=vllm", *cached)
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    assert len(list((tmp_path / "cache").glob("*/async_rollout/GBS*/*"))) >= 8  # one entry per streamed prompt
