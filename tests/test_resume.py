"""Resume after SIGKILL, for every schedule: the driver and its Ray processes die at once, as on
a lost machine, and the resumed run trains the steps and the data an uninterrupted run would."""

import os
import signal
import subprocess
import time

import pytest
from training import QUIET, command, fingerprints, metrics, train


@pytest.mark.parametrize(
    ("schedule", "role"),
    [("sync", "rollout"), ("one_step_off", "rollout"), ("fully_async", "async_rollout")],
)
def test_sigkill_resumes_at_the_next_step_with_the_same_data(ray_session, task_dir, tmp_path, schedule, role):
    """A run killed after its step-2 checkpoint resumes at step 3 and sees the batches an
    uninterrupted run sees: the prompt fingerprints of every step's (or streamed sample's)
    cache entry match, and a resumed step whose prompts differ from its cached generation's
    fails the run."""
    steps = (
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        f"trainer.schedule={schedule}",
        f"skip.{role}.enable=true",
        f"skip.{role}.steps=[{','.join(map(str, range(1, 17)))}]",
        f"skip.{role}.on_prompt_mismatch=error",
    )
    reference = tmp_path / "reference"
    train(task_dir, reference, *steps)  # uninterrupted, in this process: no Ray to start

    killed = tmp_path / "killed"
    process = subprocess.Popen(command(task_dir, killed, *steps), start_new_session=True, **QUIET)
    marker = killed / "run" / "global_step_2" / "manifest.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its Ray processes, as a lost machine would
    process.wait()
    assert marker.exists(), "the run ended before its step-2 checkpoint"
    assert not (killed / "run" / "global_step_4").exists(), "the run finished before it was killed"

    resumed = subprocess.run(command(task_dir, killed, *steps), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_at = int(resumed.stdout.split("resumed at step")[1].split()[0])
    assert resumed_at >= 2
    assert [row["step"] for row in metrics(killed / "run")] == [1, 2, 3, 4]
    assert fingerprints(killed / "cache") == fingerprints(reference / "cache")
