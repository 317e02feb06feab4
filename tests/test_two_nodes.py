"""``skip run`` on a Ray cluster of two real nodes: a head and a worker node on this machine, each
in its own mount namespace with a private ``/dev/shm`` (its object store) and temp directory
(its session, sockets and logs), joined over the network. Nothing is shared by accident: objects
move between the nodes as between machines. The rollout pool asks for ``node_b``, which only
the worker node offers, and the actor pool for ``node_a``. The run, cache and profile directories
lie under the test's directory, which both nodes see, as on NFS. The driver runs on the head.
Every engine (``hf``, ``vllm`` and ``sglang``, on CPU through tests/sglang_cpu) samples across
the nodes with the weights the trainer sent over, broadcast over the weight group (one run through
the object store instead); the overlapped schedules cross them on ``hf``
(what they ask of an engine, pause, resume and weights loaded under requests in flight, is
test_engine_commands.py's, on each engine); a third node, lost mid-run, stops the run.

Giving a process its own mount namespace needs CAP_SYS_ADMIN (CI runs as root); without it the
tests skip and say so.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_nodes import another_node, lose, namespaces_refused, node_env, two_nodes
from training import metrics, overrides

pytestmark = pytest.mark.integration  # a two-node Ray cluster on this machine

SKIP = Path(sys.executable).parent / "skip"
PLACED = ("resources.rollout.ray_resources={node_b:1}", "resources.actor.ray_resources={node_a:1}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = namespaces_refused()
    if why is not None:
        pytest.skip(f"two Ray nodes need a mount namespace each: {why}")
    with two_nodes(tmp_path_factory.mktemp("nodes")) as nodes:
        yield nodes


def on_the_head(cluster, task_dir, tmp_path, *more) -> list[str]:
    """``skip run`` on the head node, as ``RAY_ADDRESS=... skip run`` (with ``node_env``)."""
    head, _ = cluster
    return ["nsenter", f"--mount=/proc/{head}/ns/mnt", str(SKIP), "run", *overrides(task_dir, tmp_path, *more)]


def skip_run(cluster, task_dir, tmp_path, *more) -> str:
    """The run on the head node, the rollout pool on the worker node."""
    command = on_the_head(cluster, task_dir, tmp_path, *more)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=node_env(cluster[1]))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


RUN = ("trainer.total_training_steps=2", "trainer.test_freq=0", *PLACED)
VLLM = (
    "rollout.backend=vllm",
    "rollout.engine_kwargs.vllm.enforce_eager=true",
    "rollout.engine_kwargs.vllm.dtype=float32",
)
SGLANG = ("rollout.backend=sglang", "rollout.engine_kwargs.sglang.dtype=float32")


def test_sync_with_caching_and_profiling_across_two_nodes(cluster, task_dir, tmp_path):
    profile = ("profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}", "skip.rollout.enable=true")
    skip_run(cluster, task_dir, tmp_path, *RUN, *profile)
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "profile" / "step_1").iterdir()) == ["worker_-1.jsonl", "worker_0.jsonl"]
    (shape,) = (tmp_path / "cache").glob("*/GBS*")
    assert sorted(p.name for p in shape.iterdir() if p.name.isdigit()) == ["1", "2"]


@pytest.mark.parametrize("engine", [VLLM, SGLANG], ids=["vllm", "sglang"])
def test_sync_on_an_engine_across_two_nodes_samples_with_the_trainers_weights(cluster, task_dir, tmp_path, engine):
    """The engine in float32, as the trainer computes. The tiny model scores 0, so advantages are
    0: the entropy bonus and the KL loss make step 1's update move the weights, which go to the
    other node in buckets of 0.5 MiB for step 2 to sample from."""
    weights = ("rollout.update_weights_bucket_megabytes=0.5", "actor.entropy_coeff=0.01", "actor.use_kl_loss=true")
    out = skip_run(cluster, task_dir, tmp_path, *RUN, *engine, *weights, "rollout.weight_sync=group")
    assert "weight sync: over a gloo process group" in out  # the trainer's rank 0 on one node, the engine on the other
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    # |engine prob - trainer prob| of the sampled tokens, measured in process: mean 5e-9, max 1e-7
    # (float32 rounding). Step 2 on an engine that kept step 1's weights: mean 1.3e-3, max 1.1e-2;
    # the engine in bfloat16: 3.9e-5, 3.6e-4. The bounds sit between float32's noise and both faults.
    for row in rows:
        assert row["training/rollout_probs_diff_mean"] < 1e-6, row
        assert row["training/rollout_probs_diff_max"] < 1e-4, row
        assert row["response_length/mean"] > 0


def test_one_step_off_across_two_nodes_through_the_object_store(cluster, task_dir, tmp_path):
    objects = ("trainer.schedule=one_step_off", "rollout.weight_sync=object_store")
    out = skip_run(cluster, task_dir, tmp_path, *RUN, *objects)
    assert "weight sync: through Ray's object store" in out
    assert [row["training/staleness"] for row in metrics(tmp_path / "run")] == [0.0, 1.0]


def test_fully_async_with_caching_across_two_nodes(cluster, task_dir, tmp_path):
    cached = ("skip.async_rollout.enable=true", "skip.async_rollout.steps=1..16")
    skip_run(cluster, task_dir, tmp_path, *RUN, "trainer.schedule=fully_async", *cached)
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2]
    assert len(list((tmp_path / "cache").glob("*/async_rollout/GBS*/*"))) >= 8  # one entry per streamed prompt


def test_a_node_lost_with_no_room_left_stops_the_run_with_one_line_and_how_to_resume(
    cluster, task_dir, tmp_path, tmp_path_factory
):
    """The rollout pool on a third node, which is lost once step 1's checkpoint is saved: no node
    left offers ``node_c``, so Ray cannot restart the worker; the run waits ``restart_timeout_s``,
    then stops with one line."""
    steps = ("trainer.total_training_steps=3", "trainer.test_freq=0", "trainer.save_freq=1")
    placed = ("resources.rollout.ray_resources={node_c:1}", "resources.actor.ray_resources={node_a:1}")
    command = on_the_head(cluster, task_dir, tmp_path, *steps, *placed, "resources.rollout.restart_timeout_s=10")
    short = tmp_path_factory.mktemp("c")  # its sockets' paths must stay under 108 bytes
    with another_node(short, cluster[1], "node_c") as node:
        run = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=node_env(cluster[1])
        )
        while not (tmp_path / "run" / "global_step_1" / "manifest.json").exists() and run.poll() is None:
            time.sleep(0.05)
        lose(node)
        out, err = run.communicate(timeout=300)
    assert run.returncode == 1 and "Traceback" not in out + err, out[-3000:] + err[-3000:]
    (line,) = [line for line in (out + err).splitlines() if line.startswith("Error:")]
    died = r"Error: skip run stopped at step [23]: rollout worker 0 \(pid \d+ on node \S+ \(\w+\)\) died at step [23], "
    assert re.match(died, line), line
    assert "its node is gone and no node left took the worker within 10 s" in line
    assert re.search(r"rollout worker 0 \(.*\) was lost with its node at step [23]; waiting up to 10 s", err), err[
        -3000:
    ]
    assert re.search(r"resume from the newest checkpoint \(.*global_step_[12]\) with `skip run ", line)
