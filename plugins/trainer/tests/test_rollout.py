"""``skip rollout`` end to end: the embedded task, the hf backend, the agent loop and the cache."""

import re

import pytest
import skip_core.progress
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.entries import verify
from skiptests import CONFIGS, SMALL


def rollout(*overrides):
    args = ["rollout", "--config-dir", str(CONFIGS), *SMALL, *map(str, overrides)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def summary(output: str) -> dict[str, str]:
    """The rows of the summary table, by label."""
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in output.splitlines() if line.startswith("│")]
    return {row[0]: row[1] for row in cells if len(row) == 2}


@pytest.fixture(scope="module")
def task_dir(tiny_model_dir):
    """The session's embedded task directory: data and model are built once for all tests."""
    return tiny_model_dir.parent


def test_second_run_loads_the_cached_generation(task_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)  # so that a quick generation shows its progress too
    cached = [f"task.dir={task_dir}", "skip.rollout.enable=true", f"skip.rollout.dump_dir={tmp_path}"]
    first = rollout(*cached)
    assert first.exit_code == 0, first.output
    assert "4 × 2 = 8 requests" in first.output and "tokens/s" in first.output
    assert "finish reasons" in first.output and "task score" in first.output
    assert re.search(r"^generating 8/8 samples, \d+ s elapsed$", first.output, re.M)  # progress, in a pipe
    assert len(list(tmp_path.glob("*/*/1"))) == 1

    second = rollout(*cached)
    assert second.exit_code == 0, second.output
    assert "loaded from the skip cache" in second.output and "tokens/s" not in second.output
    assert re.search(r"^generating 8/8 samples", second.output, re.M)  # a cached step counts its samples too
    same = ("prompts × samples", "turns per request", "tool calls", "finish reasons", "task score (mean)")
    assert {k: summary(first.output)[k] for k in same} == {k: summary(second.output)[k] for k in same}


def test_output_dir_holds_a_verified_batch(task_dir, tmp_path):
    result = rollout(f"task.dir={task_dir}", f"output_dir={tmp_path}")
    assert result.exit_code == 0, result.output
    (entry,) = tmp_path.glob("*/*/1")
    assert verify(entry)["samples"] == 8


def test_unknown_backend_fails_before_any_work(tmp_path):
    fresh = tmp_path / "never-built"
    result = rollout(f"task.dir={fresh}", "rollout.backend=tgi")
    assert result.exit_code == 1
    assert re.search(r"rollout\.backend: unknown backend 'tgi' \(installed: .*hf", result.output)
    assert "pip install" not in result.output  # no distribution of that name exists
    assert not fresh.exists()


def test_config_errors_are_one_line(tmp_path):
    result = rollout(f"task.dir={tmp_path}", "skip.rollout.action=cahce")
    assert result.exit_code == 1
    assert "skip.rollout.action: expected 'cache' or 'repeat', got 'cahce'" in result.output
    result = rollout(f"task.dir={tmp_path}", "rollout.temperature=-1")
    assert "rollout.temperature: expected a number >= 0.0, got -1" in result.output


def test_a_model_path_that_is_not_a_model_directory_is_named(tmp_path):
    result = rollout("task.name=null", f"model.path={tmp_path}", f"data.train_files=[{tmp_path}/x.parquet]")
    assert result.exit_code == 1
    assert "model.path: expected a local Hugging Face model directory with a config.json" in result.output


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("5..1", "steps: the range '5..1' is empty: write the smaller step first"),
        ("x", "steps: expected a step (an integer from 1), a range like 1..20 or a list of them, got 'x'"),
        ("[1,two]", "steps[1]: expected a step (an integer from 1) or a range like 1..20, got 'two'"),
        ("[1,true]", "steps[1]: expected a step (an integer from 1) or a range like 1..20, got True"),
        ("0", "steps: expected steps of skip run, which start at 1, got 0"),
        ("[3,0..2]", "steps: expected steps of skip run, which start at 1, got [3, '0..2']"),
        ("-1", "steps: expected steps of skip run, which start at 1, got -1"),
        ("1..99999999999999999999", "steps: '1..99999999999999999999' is not a range of steps like 1..20"),
    ],
)
def test_bad_steps_are_one_line(tmp_path, steps, message):
    fresh = tmp_path / "never-built"
    result = rollout(f"task.dir={fresh}", f"steps={steps}")
    assert result.exit_code == 1 and result.output == f"Error: {message}\n"
    assert not fresh.exists()


def test_steps_past_the_runs_total_training_steps_are_refused_before_any_work(tmp_path):
    fresh = tmp_path / "never-built"
    result = rollout(f"task.dir={fresh}", "trainer.total_training_steps=125", "steps=[1,100..100000]")
    assert result.exit_code == 1
    assert result.output == (
        "Error: steps: 126..100000 lie past the last step of skip run with these settings "
        "(125: trainer.total_training_steps=125); ask for steps up to 125, or raise "
        "trainer.total_training_steps for skip run too\n"
    )
    assert not fresh.exists()  # the task was not even prepared


def test_steps_past_the_runs_epochs_are_refused_before_the_engine_starts(task_dir, tmp_path):
    """A million million steps: two numbers, refused by the run's length without a list of them."""
    more = ("trainer.total_training_steps=null", "steps=1..1000000000000", f"output_dir={tmp_path}")
    result = rollout(f"task.dir={task_dir}", *more)
    assert result.exit_code == 1
    *before, error = result.output.splitlines()
    assert error == (  # 64 prompts in batches of 4, one epoch
        "Error: steps: 17..1000000000000 lie past the last step of skip run with these settings (16: 16 batches "
        "of data.train_batch_size prompts in data.train_files per epoch x trainer.total_epochs=1); ask for steps "
        "up to 16, or set trainer.total_training_steps or trainer.total_epochs for skip run too"
    )
    assert before == [f"task arithmetic: data and model under {task_dir}"]
    assert not list(tmp_path.iterdir())  # not one step generated
