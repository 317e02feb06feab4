"""Faults a run on a cluster meets: a rollout worker killed mid-generation is restarted, given the
current weights, and its part generated again with the same seeds, so the run ends with the
metrics of an uninterrupted one; the actor killed stops the run with one line that says what
died and the command that resumes from the newest checkpoint."""

import contextlib
import os
import re
import signal
import threading

import psutil
import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skiptests import CONFIGS
from training import metrics, overrides, train

pytestmark = pytest.mark.integration  # workers and nodes lost mid-run

RUN = ("trainer.total_training_steps=2", "trainer.test_freq=0")
SCHEDULES = {
    "sync": ("trainer.schedule=sync",),
    "one_step_off": ("trainer.schedule=one_step_off",),
    # Streamed with no staleness and a sync per update: the samples each step trains are fixed,
    # so a sample lost and fed again, or one trained twice, shows in the metrics.
    "fully_async": (
        "trainer.schedule=fully_async",
        "async_training.staleness_threshold=0",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.partial_rollout=false",
        "algorithm.rollout_correction.bypass_mode=false",
    ),
}
SAME = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "training/staleness")


@pytest.fixture(scope="module")
def uninterrupted(task_dir, tmp_path_factory):
    """The metrics and the rollout calls of a run with no fault, once per schedule."""
    runs = {}

    def run(*args):
        if args not in runs:
            directory = tmp_path_factory.mktemp("whole")
            trainer, _ = train(task_dir, directory, *RUN, *args)
            runs[args] = metrics(directory / "run"), trainer.rollout.calls
        return runs[args]

    return run


@pytest.mark.parametrize(
    ("schedule", "backend", "noticed"),
    [
        ("sync", "dying_hf", "while generating"),
        ("one_step_off", "dying_hf", "while generating"),
        ("one_step_off", "dying_in_sync_hf", "during a weight sync"),
        ("fully_async", "dying_hf", r"while generating sample_0_\d+"),
        ("sync", "dying_group_hf", "while generating"),
    ],
)
def test_a_rollout_worker_killed_mid_generation_or_mid_sync_is_restarted_and_the_run_unchanged(
    ray_session, held_backend, task_dir, tmp_path, uninterrupted, schedule, backend, noticed
):
    """Weights go in buckets of 0.5 MiB, so a worker killed in a sync dies with some loaded.
    Under fully_async the worker dies with every sample fed so far in flight on it: each is
    generated again from its start, and no prompt is fed twice (the calls of an uninterrupted run)."""
    schedule, buckets = SCHEDULES[schedule], "rollout.update_weights_bucket_megabytes=0.5"
    whole, calls = uninterrupted(*schedule, buckets)
    lost = rf"rollout worker 0 \(pid \d+ on node .*\) was lost at step \d, noticed {noticed}"
    over = ("rollout.weight_sync=group",) if backend == "dying_group_hf" else ()
    with pytest.warns(RuntimeWarning, match=lost):
        trainer, _ = train(task_dir, tmp_path / "killed", *RUN, *schedule, buckets, f"rollout.backend={backend}", *over)
    assert trainer.rollout.restarts == 1 and trainer.rollout.calls == calls
    if backend == "dying_group_hf":  # given the weights through the object store, then in a new group
        assert trainer.rollout.group_sync.formed == 2
    killed = metrics(tmp_path / "killed" / "run")
    assert [row["step"] for row in killed] == [1, 2]
    for a, b in zip(whole, killed, strict=True):
        for key in (k for k in SAME if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_actor_killed_stops_the_run_with_one_line_naming_it_and_how_to_resume(
    ray_session, task_dir, tmp_path, workers
):
    """Sharded, one rank is killed: its peer would wait for it in a collective, and the run must
    not (the pools are freed as the run stops)."""
    run = tmp_path / "run"
    # Three steps: the actor dies after step 1's checkpoint, and steps 2 and 3 still need it.
    run_3 = ("trainer.total_training_steps=3", "trainer.test_freq=0", "trainer.save_freq=1")
    run_3 += (f"resources.actor.workers={workers}",)
    args = ["run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *run_3)]

    ended, killed = threading.Event(), []

    def kill_the_actor_after_its_first_checkpoint():
        while not (run / "global_step_1" / "manifest.json").exists():
            if ended.wait(0.05):  # the run stopped before its first checkpoint: nothing to kill
                return
        killed.append(policy_ranks()[0])  # one rank (the only one, unsharded)
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_actor_after_its_first_checkpoint, daemon=True)
    killer.start()
    result = CliRunner().invoke(cli, args)
    ended.set()
    killer.join()
    assert killed, result.output
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    rank = " of rank [01]" if workers > 1 else ""
    died = rf"Error: skip run stopped at step [23]: the actor worker{rank} \(pid \d+ on node \S+ \(\w+\)\) died: "
    assert re.match(died, line)
    assert re.search(r"resume from the newest checkpoint \(.*global_step_[12]\) with `skip run --config-dir ", line)
    assert line.endswith("(HYDRA_FULL_ERROR=1 shows the traceback)")


def test_a_rollout_worker_lost_past_its_restarts_stops_the_run_with_one_line(
    ray_session, held_backend, task_dir, tmp_path
):
    line = stopped_run(task_dir, tmp_path, "rollout.backend=dying_hf", "resources.rollout.max_restarts=0")
    lost = r"Error: skip run stopped at step 2: rollout worker 0 \(pid \d+ on node \S+ \(\w+\)\) died at step 2, "
    assert re.match(
        lost + "noticed while generating, and Ray did not restart it: past resources.rollout.max_restarts", line
    )
    assert line.endswith("(HYDRA_FULL_ERROR=1 shows the traceback)")


def test_a_rollout_worker_lost_during_a_sync_over_the_weight_group_stops_the_run_with_one_line(
    ray_session, held_backend, task_dir, tmp_path
):
    """The trainer's broadcast cannot go on without one of the group's ranks: the run stops, naming the worker."""
    line = stopped_run(task_dir, tmp_path, "rollout.backend=dying_in_group_sync_hf", "rollout.weight_sync=group")
    lost = r"Error: skip run stopped at step 1: rollout worker 0 \(pid \d+ on node \S+ \(\w+\)\) was lost at step 1 "
    cause = "its process died, and the broadcast cannot go on without it"
    assert re.match(lost + "during a weight sync over the process group: " + cause, line), line
    assert line.endswith("(HYDRA_FULL_ERROR=1 shows the traceback)")


def policy_ranks() -> list[int]:
    """The pids of this session's policy workers: started by the raylet this process started (a
    ``pgrep`` would also find another Ray's on the machine)."""
    me = os.getpid()
    ranks = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if (process.info["cmdline"] or [""])[0] == "ray::Policy" and process.parent().ppid() == me:
                ranks.append(process.pid)
    return ranks


def stopped_run(task_dir, tmp_path, *more) -> str:
    """``skip run`` of ``RUN`` that stops: its one ``Error:`` line, with no traceback printed."""
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *RUN, *more)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return line
