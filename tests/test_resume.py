"""Resume after SIGKILL, for every schedule: the driver and its Ray processes die at once, as on
a lost machine, and the resumed run trains the steps and the data an uninterrupted run would.
What a resumed run reads back may be damaged: a corrupt newest checkpoint costs neither the run
nor the checkpoint it resumes from, and a metrics line nested past any reader is dropped."""

import json
import os
import signal
import subprocess
import time

import pytest
from skip_plugin_trainer.train.checkpoint import LATEST, CheckpointWarning
from skip_plugin_trainer.train.tracking import Tracking
from training import fingerprints, held_command, metrics, train

# What each schedule caches (a batch per trainer step, or one entry per streamed sample, by feed
# index), the step whose lookup the killed run never gets past, and its last checkpoint then.
# Validation (every 2 steps) waits for the generations in flight unless they may be paused.
SCHEDULES = {
    # Step 3's batch never comes: step 2 is the last to finish.
    "sync": ("rollout", 3, 2),
    # Batch 4, drawn and started during step 3, never comes: step 3 still finishes, and its
    # checkpoint must record the loader before batch 4, not after.
    "one_step_off": ("rollout", 4, 3),
    # Sample 3 never comes: steps 1-3 train 12 of the other 15 samples, which arrive in any
    # order; step 4 waits for a 4th. The resumed run feeds sample 3 and the 3 left untrained.
    "fully_async": ("async_rollout", 3, 3),
}


def steps(schedule: str) -> tuple[str, ...]:
    role = SCHEDULES[schedule][0]
    # Every entry the run makes: a trainer step's role has the 4 steps, a streamed one 16 samples
    # (4 steps of 4 prompts); more trainer steps would be past the run's end, which it warns of.
    last = 4 if role == "rollout" else 16
    return (
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        f"trainer.schedule={schedule}",
        f"skip.{role}.enable=true",
        f"skip.{role}.steps=1..{last}",
        f"skip.{role}.on_prompt_mismatch=error",
    )


@pytest.fixture(scope="module")
def reference(ray_session, task_dir, tmp_path_factory):
    """The cache fingerprints of an uninterrupted run, in this process, once per role: what a
    trainer step or a sample sees does not depend on the schedule that trains it."""
    found = {}

    def of(schedule: str) -> dict[str, str]:
        role = SCHEDULES[schedule][0]
        if role not in found:
            tmp_path = tmp_path_factory.mktemp(f"reference-{role}")
            train(task_dir, tmp_path, *steps("sync" if role == "rollout" else schedule))
            found[role] = fingerprints(tmp_path / "cache")
        return found[role]

    return of


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_sigkill_resumes_at_the_next_step_with_the_same_data(ray_session, reference, task_dir, tmp_path, schedule):
    """A run killed after a checkpoint, with later steps' generations started or cached, resumes
    right after that checkpoint and sees the batches an uninterrupted run sees: the prompt
    fingerprints of every step's (or streamed sample's) cache entry match, and a resumed step
    whose prompts differ from its cached generation's fails the run."""
    role, held, last = SCHEDULES[schedule]
    marker, checkpoint = tmp_path / "held", tmp_path / "run" / f"global_step_{last}" / "manifest.json"
    command = held_command(task_dir, tmp_path, role, held, marker, *steps(schedule))
    log = tmp_path / "killed.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # a run that never gets there, not a slow one
    while not (marker.exists() and checkpoint.exists()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its Ray processes, as a lost machine would
    process.wait()
    assert marker.exists() and checkpoint.exists(), log.read_text(errors="replace")[-3000:]
    assert not (tmp_path / "run" / f"global_step_{last + 1}").exists()

    _, output = train(task_dir, tmp_path, *steps(schedule))  # in this process: no Ray to start
    assert f"resumed at step {last} from" in output
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert fingerprints(tmp_path / "cache") == reference(schedule)


def test_a_corrupt_newest_checkpoint_costs_neither_the_run_nor_the_checkpoint_it_resumes_from(
    ray_session, task_dir, tmp_path
):
    """The first run keeps steps 2 and 3; step 3 is damaged. The second run resumes from step 2 and
    saves every second step, so it never writes step 3 again: pruning moves step 3 aside instead of
    counting it, and keeps step 2, the checkpoint the run resumed from, while the run lasts."""
    run = tmp_path / "run"
    kept = ("trainer.test_freq=0", "trainer.max_ckpt_to_keep=2")
    train(task_dir, tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=1", *kept)
    (shard,) = (run / "global_step_3" / "actor").glob("*.safetensors")  # the policy's one rank's
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01
    shard.write_bytes(bytes(data))

    with pytest.warns(CheckpointWarning) as caught:
        _, output = train(task_dir, tmp_path, "trainer.total_training_steps=6", "trainer.save_freq=2", *kept)

    assert f"resumed at step 2 from {run / 'global_step_2'}" in output
    ignored, aside = [str(w.message) for w in caught if w.category is CheckpointWarning]
    assert ignored.startswith(f"skip: ignoring checkpoint {run / 'global_step_3'}: actor/{shard.name} does not match")
    assert f"moved it aside to {run / 'global_step_3.corrupt'}," in aside
    checkpoints = sorted(name for name in os.listdir(run) if name.startswith("global_step_"))
    assert checkpoints == ["global_step_2", "global_step_3.corrupt", "global_step_4", "global_step_6"]
    assert (run / LATEST).read_text() == "6"
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_a_metrics_line_nested_past_any_reader_is_dropped_on_resume(tmp_path):
    rows = [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.75}]
    lines = [json.dumps(rows[0]), "[" * 100_000 + "]" * 100_000, json.dumps(rows[1]), json.dumps({"step": 3})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    tracking = Tracking(["jsonl"], tmp_path, resume_step=2)
    tracking.close()
    assert tracking.history == rows
    assert metrics(tmp_path) == rows
