"""``skip run`` and ``skip rollout`` as commands: where the configs come from, Hydra composition
and its errors. Every key a declared section's model has can be overridden, and no other."""

import functools
import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from omegaconf import OmegaConf
from skip_core import plugins
from skip_core.cli import cli
from skip_core.hydra_defaults import hydra_defaults
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.config.settings import RunSettings
from skiptests import CONFIGS, ROOT


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(
    ("command", "override", "message"),
    [
        ("run", "trainer.totl_training_steps=3", r"trainer\.totl_training_steps: unknown key \(allowed: .*total_"),
        ("run", "trainr.seed=3", r"trainr: unknown key \(allowed: actor, .*\); did you mean trainer\?"),
        ("rollout", "rollout.temprature=0.5", r"did you mean rollout\.temperature\?"),
        ("run", "rollout.engine_kwargs.vllm.max_num_seq=8", r"did you mean .*\.engine_kwargs\.vllm\.max_num_seqs\?"),
        ("run", "async_training.trigger=2", r"did you mean async_training\.trigger_parameter_sync_step\?"),
    ],
)
def test_a_mistyped_override_names_the_key_and_the_allowed_ones_not_hydras_plus(command, override, message):
    result = invoke(command, override)
    assert result.exit_code == 1
    assert re.search(message, result.output)
    assert "+" not in result.output


def test_a_key_longer_than_any_file_name_is_one_line_not_hydras_file_error():
    result = invoke("run", "+" + "k" * 300 + "=1")  # Hydra looked for a config group file of that name
    assert result.exit_code == 1
    assert result.output == f"Error: {'k' * 60}...: a key of 300 characters, which no section has\n"


def test_every_key_of_a_declared_sections_model_overrides_though_the_yaml_does_not_name_it():
    """The shipped YAML names a few engine options; the vllm plugin's model has more."""
    assert "max_num_seqs" not in (ROOT / "plugins/trainer/skip_plugin_trainer/config/rollout.yaml").read_text()
    config = compose_config(None, "run", ("rollout.engine_kwargs.vllm.max_num_seqs=16", "profiling.flush_interval_s=2"))
    assert config.rollout.engine_kwargs.vllm.max_num_seqs == 16
    assert config.profiling.flush_interval_s == 2


def test_a_key_of_a_section_whose_plugin_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setenv("SKIP_PLUGINS", "skip-plugin-trainer,skip-plugin-arithmetic,skip-plugin-hf")
    plugins._reset_for_tests()
    try:
        result = invoke("run", "profiling.flush_interval_s=2")
    finally:
        monkeypatch.delenv("SKIP_PLUGINS")
        plugins._reset_for_tests()
    assert result.exit_code == 1
    hint = r"profiling comes with a plugin that is not installed: .*pip install \./plugins/profiling"
    assert re.search(hint, result.output)


def test_a_config_of_the_users_own_includes_the_shipped_one():
    """``configs/experiment.yaml`` of this repository is the README's example of one."""
    config = compose_config(ROOT / "configs", "experiment", ("trainer.seed=3",))
    trainer = config.trainer
    assert (trainer.experiment_name, trainer.total_training_steps, config.rollout.n) == ("experiment", 8, 8)
    assert (config.trainer.seed, config.data.train_batch_size) == (3, 16)  # an override; the shipped run.yaml's value


def test_the_long_tail_workload_is_a_shipped_config_named_on_the_command_line():
    """``skip run --config-name long_tail``: the default run on problems with long chains, its task
    built in a directory of its own, every section valid under each schedule."""
    default = RunSettings.from_config(compose_config(None, "run", ()))
    for schedule in ("sync", "one_step_off", "fully_async"):
        settings = RunSettings.from_config(compose_config(None, "long_tail", (f"trainer.schedule={schedule}",)))
        assert (settings.trainer.schedule, settings.trainer.experiment_name) == (schedule, "long_tail")
    task = settings.task
    assert (task.long_share, task.long_operations, default.task.long_share) == (0.15, [10, 16], 0.0)
    assert task.dir != default.task.dir and settings.model.path == f"{task.dir}/model"
    result = invoke("run", "--config-name", "long_tail", "task.long_operations=[2,5]")
    assert result.exit_code == 1
    assert "task.long_operations: expected [least, most] with 3 <= least <= most <= 16, got [2, 5]" in result.output


def test_a_config_that_is_nowhere_names_where_it_was_looked_for(tmp_path):
    result = invoke("run", "--config-dir", str(tmp_path), "--config-name", "mine")
    assert result.exit_code == 2
    assert (
        f"--config-name: no mine.yaml in {tmp_path} or the shipped configs (long_tail, rollout, run)" in result.output
    )
    result = invoke("run", "--config-dir", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "--config-dir: no such directory" in result.output


def test_other_hydra_errors_are_usage_errors():
    result = invoke("run", "trainer.seed")
    assert result.exit_code == 2 and "trainer.seed" in result.output


def test_the_commands_module_imported_first_still_gives_skip_its_commands():
    """A script (or a test) importing the trainer's commands before ``skip_core.cli``: the cli
    then loads the plugins' commands, this module's among them, with no circular import."""
    code = "import json, skip_plugin_trainer.commands\nfrom skip_core.cli import cli\n"
    code += "print(json.dumps(sorted(cli.commands)))"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"run", "rollout", "diff"} <= set(json.loads(done.stdout)), done.stdout


# The shipped YAML and what each includes (its ``defaults`` list): a value is needed only where it
# differs from what the file would get without it.
SHIPPED = {"rollout.yaml": [], "run.yaml": ["rollout.yaml"], "long_tail.yaml": ["rollout.yaml", "run.yaml"]}
ABSENT = object()  # a key no section declares (``steps``, ``output_dir``): the file's own


def shipped(name: str) -> dict:
    """A shipped file's values as Hydra reads them (``1e-4`` a float), without its ``defaults``."""
    values = OmegaConf.to_container(OmegaConf.load(CONFIGS / name))
    values.pop("defaults", None)
    return values


def copied_defaults(read) -> list[str]:
    """Each value of the files ``read`` gives that equals what the file gets without it: the
    section's default (``skip_defaults``), or the value of a file it includes."""
    reg = plugins.registry()
    typed = hydra_defaults({name: role.config for name, role in reg.roles.items()}, reg.sections)
    copies = []
    for name, included in SHIPPED.items():
        below = OmegaConf.to_container(OmegaConf.merge(typed, *map(read, included)))
        for path, value in _leaves(read(name)):
            default = functools.reduce(
                lambda node, key: node.get(key, ABSENT) if isinstance(node, dict) else ABSENT, path, below
            )
            if default == value and isinstance(default, bool) == isinstance(value, bool):
                copies.append(f"{name}: {'.'.join(path)}={value!r}")
    return copies


def test_the_shipped_yaml_holds_no_value_that_the_typed_defaults_already_give():
    """A copy of a default would silently override a changed default."""
    assert copied_defaults(shipped) == []


def test_a_copied_default_is_caught():
    def planted(name: str) -> dict:
        values = shipped(name)
        if name == "run.yaml":
            values["actor"]["ppo_epochs"] = 1  # ActorConfig's default
            values["data"] = {"max_prompt_length": 160}  # rollout.yaml's
        return values

    assert copied_defaults(planted) == ["run.yaml: actor.ppo_epochs=1", "run.yaml: data.max_prompt_length=160"]


def _leaves(node: dict, path: tuple = ()):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value
