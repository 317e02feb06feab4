"""Replaying a cache in ``skip run`` only when it fits: an entry resealed with another dtype is
generated again with a warning naming it, a cache made under another setup says which keys
differ (or stops the run, as ``skip.rollout.on_setup_mismatch`` says), and a policy of ``error``
stops the run in one line before any worker is placed."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from skip_core.caching import PromptMismatchError, SetupMismatchWarning
from skip_core.cli import cli
from skip_core.entries import META, seal
from skip_core.manager import SkipManager
from skip_core.store import CacheWarning
from skiptests import CONFIGS
from training import metrics, overrides, train

pytestmark = pytest.mark.integration  # runs replaying resealed and changed entries

STEPS = ("trainer.total_training_steps=2", "trainer.test_freq=0")


def cached(cache: Path) -> tuple[str, ...]:
    return ("skip.rollout.enable=true", f"skip.rollout.dump_dir={cache}")


@pytest.fixture(scope="module")
def filled(task_dir, tmp_path_factory) -> Path:
    """Steps 1 and 2 of the tests' run, as ``skip rollout`` generates them at temperature 1."""
    root = tmp_path_factory.mktemp("filled")
    args = ["rollout", "--config-dir", str(CONFIGS), *overrides(task_dir, root), *cached(root / "cache"), "steps=1..2"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return root / "cache"


def copy(filled: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the filled cache, and its namespace directory (where the steps are)."""
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    (directory,) = cache.glob("*/GBS*")
    return cache, directory


def run_command(task_dir, tmp_path, *more):
    args = ["run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *more)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_a_resealed_rollout_is_refused_naming_it_and_generated_again(ray_session, task_dir, tmp_path, filled):
    cache, directory = copy(filled, tmp_path)
    tensors = {key: value.clone() for key, value in load_file(directory / "1" / "tensors.safetensors").items()}
    tensors["responses"] = tensors["responses"].float()  # the reward would decode floats, and crash
    save_file(tensors, directory / "1" / "tensors.safetensors")
    meta = json.loads((directory / "1" / META).read_text())
    meta["files"]["tensors.safetensors"] = seal(directory / "1" / "tensors.safetensors")
    (directory / "1" / META).write_text(json.dumps(meta))
    with pytest.warns(CacheWarning) as said:
        trainer, _ = train(task_dir, tmp_path, *cached(cache), *STEPS)
    (warning,) = [str(w.message) for w in said if "does not fit" in str(w.message)]
    assert str(directory / "1") in warning and "responses is float32, expected int64" in warning
    assert trainer.rollout.calls == 1  # step 1 generated again, step 2 replayed
    assert [row["step"] for row in metrics(tmp_path / "run") if row["step"] > 0] == [1, 2]
    assert load_file(directory / "1" / "tensors.safetensors")["responses"].dtype.is_floating_point is False


def test_a_changed_temperature_is_named_and_replayed_by_default(ray_session, task_dir, tmp_path, filled):
    cache, _ = copy(filled, tmp_path)
    with pytest.warns(SetupMismatchWarning) as said:
        trainer, _ = train(task_dir, tmp_path, *cached(cache), *STEPS, "rollout.temperature=0.3")
    (warning,) = [str(w.message) for w in said if issubclass(w.category, SetupMismatchWarning)]
    assert "rollout.temperature (1.0 there, 0.3 here)" in warning and "on_setup_mismatch=warn" in warning
    assert trainer.rollout.calls == 0


def test_on_setup_mismatch_error_stops_in_one_line_before_any_worker(task_dir, tmp_path, filled):
    cache, directory = copy(filled, tmp_path)
    more = (*cached(cache), *STEPS, "rollout.temperature=0.3", "skip.rollout.on_setup_mismatch=error")
    result = run_command(task_dir, tmp_path, *more)
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert f"the cached result in {directory / '1'} was generated under another setup" in line
    assert "rollout.temperature (1.0 there, 0.3 here)" in line and "skip.rollout.on_setup_mismatch=error" in line
    assert "training 2 steps" in result.output and "train-only" not in result.output


def test_on_prompt_mismatch_error_stops_in_one_line_before_any_worker(task_dir, tmp_path, filled):
    from rich.console import Console
    from skip_plugin_trainer.commands import compose_config
    from skip_plugin_trainer.train.trainer import Trainer

    cache, _ = copy(filled, tmp_path)
    more = (*cached(cache), *STEPS, "data.seed=7", "skip.rollout.on_prompt_mismatch=error")  # other prompts
    trainer = Trainer(compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, *more))), Console())
    try:
        with pytest.raises(PromptMismatchError, match="different inputs than this call's"):
            trainer.start()
        assert trainer.cluster.pools == []  # raised by the plan, before a pool was placed
    finally:
        trainer.close()
        SkipManager.reset()
    result = run_command(task_dir, tmp_path, *more)
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "skip.rollout.on_prompt_mismatch=error" in line
