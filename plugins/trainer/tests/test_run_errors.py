"""What a user can get wrong, or a machine can run out of, in ``skip run``: each is one line naming
the key or the file, the reason and the way out, with no traceback. Settings fail before Ray
starts (``run`` says "training N steps" just before it starts Ray); a disk that fills up stops
the run with the checkpoint it could not save and the command that resumes from the last one."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from safetensors.torch import save_file
from skip_core.cli import cli
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.train.checkpoint import LATEST, CheckpointManager
from skip_plugin_trainer.train.preflight import UnreachableStepsWarning
from skip_plugin_trainer.train.trainer import Trainer
from skiptests import CONFIGS
from training import command, overrides

WAY_BACK = (
    "point it at another global_step_<k> directory, or set trainer.resume_mode=auto to resume from the newest "
    "checkpoint in trainer.default_local_dir that verifies"
)


def skip_run(*args: str) -> str:
    """The one line ``skip run`` fails with, checked to be all it printed."""
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *args])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (line,) = result.output.splitlines()  # nothing else: no "training N steps", so Ray never started
    assert line.startswith("Error: ")
    return line.removeprefix("Error: ")


def namespaces_refused() -> str | None:
    """Why this machine cannot give a command a mount namespace of its own with a tmpfs, or None."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"]
    done = subprocess.run(probe, capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"a user and mount namespace with a tmpfs is refused here: {done.stderr}"


def on_tmpfs(mount: Path, options: str, args: list[str], copy_to: Path) -> subprocess.CompletedProcess:
    """``args`` run with a tmpfs mounted at ``mount`` (in a namespace of its own: it vanishes with
    the command), whose contents are copied to ``copy_to`` once the command ended."""
    mount.mkdir()
    script = (
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mount))} || exit 99; "
        f"{shlex.join(args)}; status=$?; cp -a {shlex.quote(str(mount))} {shlex.quote(str(copy_to))}; exit $status"
    )
    namespaced = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # which would print the traceback
    return subprocess.run(namespaced, capture_output=True, text=True, check=False, env=env)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output[-5000:]
    (line,) = [line for line in output.splitlines() if line.startswith("Error:")]
    return line.removeprefix("Error: ")


@pytest.mark.parametrize(
    ("backend", "module"), [("wandb", "wandb"), ("tensorboard", "tensorboard")], ids=["wandb", "tensorboard"]
)
def test_a_logger_that_is_not_installed_names_trainer_logger_and_what_to_install(
    task_dir, tmp_path, monkeypatch, backend, module
):
    """The library is made to fail its import, as when it is not installed, whether it is or not."""
    shadow = tmp_path / "shadow" / module
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError(\"No module named '{module}'\")\n")
    monkeypatch.syspath_prepend(str(shadow.parent))
    for name in (module, "torch.utils.tensorboard"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    line = skip_run(*overrides(task_dir, tmp_path, f"trainer.logger=[console,jsonl,{backend}]"))
    assert line == (
        f"trainer.logger: {backend} cannot be imported (No module named '{module}'); install it with "
        f"`pip install {module}`, or drop {backend} from trainer.logger"
    )
    assert not (tmp_path / "run").exists()


SHARD = "actor/shard-00001-model-00001-of-00001.safetensors"


def one_shard(directory: Path) -> dict:
    """A stand-in for the policy's ranks: one actor shard file (the run never gets to read it)."""
    (directory / "actor").mkdir()
    save_file({"w": torch.zeros(2)}, str(directory / SHARD))
    return {"actor": {"param_groups": None}}


def corrupt(path: Path) -> str:
    data = bytearray((path / SHARD).read_bytes())
    data[-2] ^= 0x01
    (path / SHARD).write_bytes(bytes(data))
    return re.escape(SHARD) + " does not match its recorded hash"


def nested(path: Path) -> str:
    (path / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    return r"manifest\.json\b.*nested 100000 levels deep[^;]*"


def missing(path: Path) -> str:
    shutil.rmtree(path)
    return "no such directory"


@pytest.mark.parametrize("damage", [corrupt, nested, missing])
def test_a_resume_from_path_that_does_not_verify_is_one_line_with_the_way_back(task_dir, tmp_path, damage):
    path = CheckpointManager(tmp_path / "elsewhere").save(3, {}, {}, one_shard)
    reason = damage(path)

    line = skip_run(
        *overrides(task_dir, tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={path}")
    )
    start = f"trainer.resume_from_path: cannot resume from {path}: "
    assert re.fullmatch(re.escape(start) + reason + re.escape(f"; {WAY_BACK}"), line), line
    assert not (tmp_path / "run").exists()


def test_a_task_dir_that_cannot_be_written_names_task_dir_the_path_and_the_reason(task_dir, tmp_path):
    (tmp_path / "afile").write_text("a file, where task.dir wants a directory (chmod stops no root)")
    bad = tmp_path / "afile" / "task"

    line = skip_run(*overrides(task_dir, tmp_path), f"task.dir={bad}")  # the later override wins
    assert line == (
        f"task.dir: the arithmetic task cannot build its data and model in {bad}: Not a directory "
        f"({bad / 'data'}); point task.dir at a directory you can write"
    )
    assert not (tmp_path / "run").exists()


def test_a_run_directory_that_cannot_be_written_names_the_key_the_path_and_the_reason(task_dir, tmp_path):
    (tmp_path / "afile").write_text("a file, where the run directory should go")
    bad = tmp_path / "afile" / "run"

    line = skip_run(*overrides(task_dir, tmp_path), f"trainer.default_local_dir={bad}")
    assert line == (
        f"trainer.default_local_dir: cannot write the run directory {bad}: Not a directory; "
        "point trainer.default_local_dir at a directory you can write"
    )


@pytest.mark.integration
def test_a_run_directory_on_a_read_only_file_system_is_one_line(task_dir, tmp_path):
    if reason := namespaces_refused():
        pytest.skip(reason)
    mount = tmp_path / "readonly"
    done = on_tmpfs(mount, "ro,size=64k", command(task_dir, tmp_path, f"trainer.default_local_dir={mount}/run"),
                    tmp_path / "after")  # fmt: skip
    assert one_error_line(done) == (
        f"trainer.default_local_dir: cannot write the run directory {mount}/run: Read-only file system; "
        "point trainer.default_local_dir at a directory you can write"
    )


def trainer_warnings(task_dir, tmp_path, *more: str) -> list[str]:
    """The ``UnreachableStepsWarning`` lines of a trainer set up (not started: no Ray) with ``more``."""
    config = compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, "skip.rollout.enable=true", *more)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(config, Console(quiet=True)).close()
    return [str(w.message) for w in caught if issubclass(w.category, UnreachableStepsWarning)]


def test_steps_of_a_role_past_the_runs_last_step_are_named_in_one_warning(task_dir, tmp_path):
    assert trainer_warnings(task_dir, tmp_path, "skip.rollout.steps=[3,1..1000000000000]") == [
        "skip.rollout.steps: steps 21..1000000000000 lie past this run's last step 20 "
        "(trainer.total_training_steps); they are never reached"
    ]
    assert trainer_warnings(task_dir, tmp_path, "trainer.total_training_steps=4", "skip.rollout.steps=[2,5]") == [
        "skip.rollout.steps: step 5 lies past this run's last step 4 (trainer.total_training_steps); "
        "it is never reached"
    ]


def test_the_shipped_steps_of_every_step_warn_of_nothing(task_dir, tmp_path):
    """run.yaml lists the steps as ``1..``, every step, whatever the run's length or how it is set."""
    assert trainer_warnings(task_dir, tmp_path) == []
    assert trainer_warnings(task_dir, tmp_path, "trainer.total_training_steps=7") == []
    assert trainer_warnings(task_dir, tmp_path, "trainer.total_training_steps=null") == []  # by epochs


@pytest.mark.integration
def test_a_full_disk_stops_the_run_with_one_line_naming_the_checkpoint_and_the_last_good_one(task_dir, tmp_path):
    """A real full disk: the run directory is a tmpfs with room for one checkpoint of the small
    run, about three times its model (the weights and AdamW's two moments), and not for two."""
    if reason := namespaces_refused():
        pytest.skip(reason)
    disk, after = tmp_path / "disk", tmp_path / "after"
    room = 5 * (Path(task_dir) / "model" / "model.safetensors").stat().st_size // 1024
    run = ("trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=0")
    done = on_tmpfs(
        disk, f"size={room}k", command(task_dir, tmp_path, *run, f"trainer.default_local_dir={disk}"), after
    )

    line = one_error_line(done)
    assert line.startswith(
        f"skip run stopped at step 2: cannot save its checkpoint {disk / 'global_step_2'}: No space left on device; "
        f"resume from the newest checkpoint ({disk / 'global_step_1'}) with `skip run --config-dir "
    ), line
    assert line.endswith("(HYDRA_FULL_ERROR=1 shows the traceback)")
    # No half checkpoint left behind, and the one before intact.
    assert sorted(os.listdir(after)) == ["global_step_1", LATEST, "metrics.jsonl"]
    assert (after / LATEST).read_text() == "1"
    assert CheckpointManager(after).load(1).trainer["global_steps"] == 1
