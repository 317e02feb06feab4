"""``skip run`` and ``skip rollout`` as commands: Hydra composition and its errors."""

import re

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skiptests import CONFIGS


@pytest.mark.parametrize(
    ("command", "override", "message"),
    [
        ("run", "trainer.totl_training_steps=3", r"trainer\.totl_training_steps: unknown key \(allowed: .*total_"),
        ("run", "trainr.seed=3", r"trainr: unknown key \(allowed: actor, .*\); did you mean trainer\?"),
        ("rollout", "rollout.temprature=0.5", r"did you mean rollout\.temperature\?"),
    ],
)
def test_a_mistyped_override_names_the_key_and_the_allowed_ones_not_hydras_plus(command, override, message):
    result = CliRunner().invoke(cli, [command, "--config-dir", str(CONFIGS), override])
    assert result.exit_code == 1
    assert re.search(message, result.output)
    assert "+" not in result.output


def test_other_hydra_errors_are_usage_errors():
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), "trainer.seed"])
    assert result.exit_code == 2 and "trainer.seed" in result.output
