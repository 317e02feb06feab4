"""``--check`` stops on the line the command stops on: each refusal of ``skip run`` and ``skip
rollout`` made both ways, with the same error line and the same warnings before it."""

import re
import warnings

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skiptests import CONFIGS
from training import overrides

# (command, what is wrong, the overrides that make it so, the start of the error line)
REFUSALS = [
    ("rollout", "steps past a set last step", ["steps=1..1000000000000"], r"steps: 21\.\.1000000000000 lie past"),
    (
        "rollout",
        "steps past the epochs of the data",
        ["trainer.total_training_steps=null", "trainer.total_epochs=1", "steps=1..1000"],
        r"steps: 17\.\.1000 lie past the last step of skip run with these settings \(16: 16 batches",
    ),
    ("rollout", "a reward file not there", ["+custom_reward_function.path=absent.py"], r"reward\.custom_reward"),
    (
        "rollout",
        "samples longer than the model's positions",
        ["data.max_response_length=4096"],
        r"data\.max_response_length: a prompt of up to data\.max_prompt_length=\d+ tokens and its response",
    ),
    ("run", "a logger not known", ["trainer.logger=[console,carrier_pigeon]"], r"trainer\.logger"),
    (
        "run",
        "colocated engines with an overlapping schedule",
        ["resources.colocate=true", "trainer.schedule=one_step_off"],
        r"resources\.colocate: the engines sleep while the actor trains",
    ),
    (
        "run",
        "validation prompts the workers cannot split, and steps past the run",
        [
            "data.train_batch_size=6",
            "resources.rollout.workers=3",
            "skip.rollout.enable=true",
            "skip.rollout.steps=1..2000",
        ],
        r"resources\.rollout\.workers: 3 workers cannot split the 8 validation prompts",
    ),
    (
        "run",
        "samples longer than the model's positions",
        ["data.max_response_length=4096"],
        r"data\.max_response_length: .* model\.path has 1024 \(max_position_embeddings\)",
    ),
    (
        "run",
        "a dataset class not there",
        ["+data.custom_cls.path=absent.py", "+data.custom_cls.name=QA"],
        r"data\.custom_cls\.path: no such file",
    ),
]


def invoke(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The error line ``skip <command> args`` stops with and the warnings it gave before it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(cli, [command, "--config-dir", str(CONFIGS), *args])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    ours = {f"{w.category.__name__}: {w.message}" for w in caught if w.category.__module__.startswith("skip")}
    return error, sorted(ours)


@pytest.mark.parametrize(
    ("command", "overridden", "message"),
    [(command, more, message) for command, _, more, message in REFUSALS],
    ids=[why for _, why, _, _ in REFUSALS],
)
def test_check_refuses_what_the_command_refuses_in_the_same_line(
    task_dir, tmp_path, monkeypatch, command, overridden, message
):
    monkeypatch.chdir(tmp_path)
    args = overrides(task_dir, tmp_path, *overridden)
    if command == "rollout":  # the rollout's own keys: no actor, no Ray pools
        args = [arg for arg in args if not arg.startswith(("actor.", "resources.", "trainer.val_before"))]
    checked, checked_warnings = invoke(command, ["--check", *args])
    ran, ran_warnings = invoke(command, args)
    assert re.match(f"^Error: {message}", ran), ran
    assert checked == ran
    assert checked_warnings == ran_warnings
    if "skip.rollout.steps=1..2000" in overridden:
        assert any("UnreachableStepsWarning: skip.rollout.steps: steps" in w for w in ran_warnings)
