"""The settings of a run: every declared section validated once, typed, and cross-checked; and the
default torch threads per worker (never more threads at once than the pools' CPUs)."""

import pytest
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_plugin_arithmetic.task import ArithmeticOptions
from skip_plugin_hf.options import HFOptions
from skip_plugin_trainer.run_sections import Resources
from skip_plugin_trainer.settings import SECTIONS, RunSettings


@pytest.mark.parametrize("workers", [1, 2])
def test_default_threads_add_up_to_the_pools_cpus_whatever_runs_at_once(workers):
    resources = Resources.model_validate({"rollout": {"workers": workers, "cpus_per_worker": 1}, "actor": {"cpus": 2}})
    cpus = workers + 2
    # sync: the rollout workers generate together, then the actor trains alone
    assert resources.threads(1, overlapped=False, together=workers) == cpus // workers
    assert resources.threads(2, overlapped=False) == cpus
    # overlapped: every worker runs at once, each on its own CPUs
    assert workers * resources.threads(1, overlapped=True, together=workers) + resources.threads(2, True) == cpus


def test_torch_threads_wins():
    resources = Resources.model_validate({"torch_threads": 3})
    assert resources.threads(1, overlapped=False, together=2) == resources.threads(1, overlapped=True) == 3


# -- every section, validated once ----------------------------------------------------------


def settings(**sections) -> RunSettings:
    return RunSettings.from_config({"task": {"name": None}, **sections})


def test_the_trainers_sections_are_declared_like_any_plugins():
    declared = registry().sections
    assert all(declared[key] is model for key, model in SECTIONS.items())
    assert declared["rollout.hf"] is HFOptions


def test_each_section_arrives_typed_and_the_rollout_section_excludes_the_backends_own():
    s = settings(rollout={"n": 3, "hf": {"max_batch_size": 7}}, data={"max_response_length": 32})
    assert (s.rollout.n, s.rollout.response_length, s.backend) == (3, 32, "hf")
    assert s.sections[HFOptions].max_batch_size == 7


def test_a_task_section_is_validated_by_the_named_tasks_own_options():
    s = settings(task={"name": "arithmetic", "dir": "d", "train_size": 10})
    assert isinstance(s.task, ArithmeticOptions) and (s.task.train_size, s.task.dir) == (10, "d")
    unknown = r"unknown key \(allowed: dir, long_operations, long_share, name, seed, train_size, .*\)"
    with pytest.raises(ConfigError, match=rf"^task\.trian_size: {unknown}; did you mean task\.train_size\?$"):
        settings(task={"name": "arithmetic", "trian_size": 10})
    with pytest.raises(ConfigError, match=r"^task\.name: unknown task 'algebra' \(installed: arithmetic\)$"):
        settings(task={"name": "algebra"})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"actor": {"ppo_mini_batch_size": 3}}, r"^actor\.ppo_mini_batch_size: 3 prompts do not divide .*=1024$"),
        ({"rollout": {"backend": "tgi"}}, r"^rollout\.backend: unknown backend 'tgi' \(installed: "),
        ({"rollout": {"hff": {}}}, r"^rollout\.hff: unknown key \(allowed: backend, .*\); did you mean rollout\.hf\?$"),
        ({"trainer": {"logger": ["mlflow"]}}, r"^trainer\.logger\[0\]: expected 'console', 'jsonl', 'tensorboard' or"),
    ],
)
def test_bad_settings_fail_at_once_naming_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        settings(**sections)


def test_the_identity_a_checkpoint_records_names_what_a_run_cannot_change():
    one = settings(trainer={"schedule": "sync"})
    other = settings(trainer={"schedule": "one_step_off", "total_training_steps": 9})
    assert one.identity()["trainer.schedule"] == "sync"
    changed = {key for key in one.identity() if one.identity()[key] != other.identity()[key]}
    assert changed == {"trainer.schedule"}  # the length of a run may change when it resumes
