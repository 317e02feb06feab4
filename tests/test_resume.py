"""Resume after SIGKILL, for every schedule: the driver and its Ray processes die at once, as on
a lost machine, and the resumed run trains the steps and the data an uninterrupted run would.
What a resumed run reads back may be damaged: a corrupt newest checkpoint costs neither the run
nor the checkpoint it resumes from, shards recorded again over other contents are passed over
as corrupt, and a metrics line nested past any reader is dropped. A run directory is one run's:
a second run on it stops in one line."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file
from skip_core import entries
from skip_core.cli import cli
from skip_core.store import CacheStore
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.train.checkpoint import LATEST, CheckpointWarning
from skip_plugin_trainer.train.tracking import Tracking
from skiptests import CONFIGS
from training import fingerprints, held_command, metrics, overrides, train

pytestmark = pytest.mark.integration  # runs killed and resumed

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


def skip_run_fails(*args: str) -> list[str]:
    """The lines of a ``skip run`` (in this process) that fails with one ``Error:`` line, the last."""
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *args])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = result.output.splitlines()
    assert [line for line in lines if line.startswith("Error:")] == lines[-1:], result.output
    return lines


HOLD = "import sys; from skip_core import files\nwith files.exclusive(sys.argv[1], 'skip run'): print(); input()"


def test_a_second_run_on_a_run_directory_in_use_stops_in_one_line_naming_the_first(task_dir, tmp_path):
    """Two runs on one directory would delete each other's saves and interleave their metrics. The
    first holds the directory (here a process holding it as ``skip run`` does) until it ends."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()
        lines = skip_run_fails(*overrides(task_dir, tmp_path))
        assert os.listdir(run) == [".skip.lock"]  # the holder's: nothing written
    finally:
        holder.communicate(b"\n")
    assert lines == [  # alone: it said nothing of "training N steps", which comes just before Ray starts
        f"Error: trainer.default_local_dir: {run} is in use by pid {holder.pid} on {socket.gethostname()} "
        "(skip run); wait for it to end, or give this run another directory"
    ]


def test_a_second_run_on_a_cache_namespace_in_use_stops_in_one_line_naming_the_first(task_dir, tmp_path):
    """Two runs dumping one namespace would replace each other's entries as they are read."""
    cache = tmp_path / "cache"
    args = [*overrides(task_dir, tmp_path), "skip.rollout.enable=true", f"skip.rollout.dump_dir={cache}"]
    settings = RunSettings.from_config(compose_config(CONFIGS, "run", tuple(args)))
    namespace = str(CacheStore(cache, settings.namespace, "rollout").directory)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, namespace], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()
        lines = skip_run_fails(*args)
    finally:
        holder.communicate(b"\n")
    assert lines == [
        f"Error: skip.rollout.dump_dir: {namespace} is in use by pid {holder.pid} on {socket.gethostname()} "
        "(skip run); wait for it to end, or give this run another directory"
    ]
    assert not (tmp_path / "run").exists()  # nothing of the run written


def as_float16(checkpoint, keep_record: bool) -> None:
    """The policy's shard stored as float16 where float32 was written, its size and hash recorded
    again; ``keep_record=False``: as a manifest written before records were kept, which has none."""
    (shard,) = (checkpoint / "actor").glob("*.safetensors")
    with safe_open(str(shard), "pt") as f:
        metadata, tensors = f.metadata(), {key: f.get_tensor(key).half() for key in f.keys()}  # noqa: SIM118
    save_file(tensors, str(shard), metadata=metadata)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    entry = manifest["files"][f"actor/{shard.name}"]
    entry.update(entries.seal(shard))
    if not keep_record:
        entry.pop("tensors", None)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_shards_recorded_again_as_float16_are_passed_over_and_kept_aside_never_loaded(ray_session, task_dir, tmp_path):
    """Step 3's shard holds float16 under a record of float32: the driver refuses it from its header.
    Step 2's has no record to compare (an older manifest): the policy's rank refuses it before
    reading a byte, and the run falls back to step 1 as it would past a hash that does not verify.
    Saving steps 2 and 3 again keeps the damaged ones aside. Named by ``resume_from_path``, step 2
    stops the run in one line."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "global_step_2"
    steps = ("trainer.save_freq=1", "trainer.test_freq=0", "trainer.max_ckpt_to_keep=3")
    train(task_dir, tmp_path, "trainer.total_training_steps=3", *steps)
    as_float16(run / "global_step_3", keep_record=True)
    as_float16(run / "global_step_2", keep_record=False)
    shutil.copytree(run / "global_step_2", elsewhere)

    with pytest.warns(CheckpointWarning) as caught:
        _, output = train(task_dir, tmp_path, "trainer.total_training_steps=4", *steps)

    assert f"resumed at step 1 from {run / 'global_step_1'}" in output
    three, two, aside_two, aside_three = [str(w.message) for w in caught if w.category is CheckpointWarning]
    assert three.startswith(f"skip: ignoring checkpoint {run / 'global_step_3'}: actor/shard-00001-model-00001-of-")
    assert "as float16 [" in three and ", its manifest records float32 [" in three
    misfit = "the actor's shards do not load: model.model.embed_tokens.weight is stored as float16 ["
    assert two.startswith(f"skip: ignoring checkpoint {run / 'global_step_2'}: {misfit}"), two
    assert f"moved it aside to {run / 'global_step_2.corrupt'}," in aside_two
    assert f"moved it aside to {run / 'global_step_3.corrupt'}," in aside_three
    assert [row["step"] for row in metrics(run)] == [1, 2, 3, 4]

    *_, line = skip_run_fails(
        *overrides(task_dir, tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={elsewhere}")
    )
    assert line.startswith(f"Error: trainer.resume_from_path: cannot resume from {elsewhere}: {misfit}"), line
    assert line.endswith("; point it at another global_step_<k> directory, or set trainer.resume_mode=auto to "
                         "resume from the newest checkpoint in trainer.default_local_dir that verifies")  # fmt: skip
