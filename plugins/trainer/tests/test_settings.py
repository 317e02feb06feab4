"""The settings of a run: every declared section validated once, typed, and cross-checked; and the
default torch threads per worker (never more threads at once than the pools' CPUs)."""

import os

import pytest
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_plugin_arithmetic.task import ArithmeticOptions
from skip_plugin_hf.options import HFOptions
from skip_plugin_trainer.config.sections import Resources
from skip_plugin_trainer.config.settings import SECTIONS, RunSettings


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
        (
            {"actor": {"ppo_mini_batch_size": 3}},
            r"^actor\.ppo_mini_batch_size: 3 prompts do not divide .*=1024; values that divide it: 1, 2, 4, 8$",
        ),
        (  # docs/training.md's rollout.n=5 on the defaults: the error names the micro-batches that fit
            {"rollout": {"n": 5}, "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size": 32}},
            r"^actor\.ppo_micro_batch_size: 32 samples do not .* = 40 samples; values that divide it: 8, 10, 20, 40$",
        ),
        ({"rollout": {"backend": "tgi"}}, r"^rollout\.backend: unknown backend 'tgi' \(installed: "),
        ({"rollout": {"hff": {}}}, r"^rollout\.hff: unknown key \(allowed: backend, .*\); did you mean rollout\.hf\?$"),
        ({"trainer": {"logger": ["mlflow"]}}, r"^trainer\.logger\[0\]: expected 'console', 'jsonl', 'tensorboard' or"),
    ],
)
def test_bad_settings_fail_at_once_naming_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        settings(**sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"actor": {"optim": {"lr": 1e9}}}, r"^actor\.optim\.lr: expected a number <= 1\.0, got 1000000000\.0$"),
        ({"trainer": {"save_freq": -3}}, r"^trainer\.save_freq: expected an integer >= -1, got -3$"),
        ({"trainer": {"test_freq": -2}}, r"^trainer\.test_freq: expected an integer >= -1, got -2$"),
        ({"trainer": {"seed": 2**80}}, r"^trainer\.seed: expected an integer <= 4294967295, got 12089\d+$"),
        ({"data": {"seed": 2**32}}, r"^data\.seed: expected an integer <= 4294967295"),
        ({"rollout": {"seed": -1}}, r"^rollout\.seed: expected an integer >= 0"),
        ({"data": {"max_prompt_length": 10**18}}, r"^data\.max_prompt_length: expected an integer <= 16777216, got"),
        ({"data": {"max_response_length": 2**24 + 1}}, r"^data\.max_response_length: expected an integer <= 16777216"),
        ({"rollout": {"max_model_len": 10**12}}, r"^rollout\.max_model_len: expected an integer <= 16777216"),
        ({"trainer": {"experiment_name": "x" * 256}}, r"^trainer\.experiment_name: at most 255 bytes, as a file name"),
        ({"trainer": {"project_name": "é" * 128}}, r"^trainer\.project_name: at most 255 bytes, .* has 256\)"),
        ({"trainer": {"default_local_dir": "runs/" + "x" * 300}}, r"^trainer\.default_local_dir: a path of at most"),
        ({"trainer": {"default_local_dir": "/r/" * 1400}}, r"^trainer\.default_local_dir: a path of at most 4095"),
    ],
)
def test_values_that_can_only_be_a_mistake_fail_naming_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        settings(**sections)


def test_a_run_directory_behind_a_link_that_loops_fails_naming_the_key(tmp_path):
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"^trainer\.default_local_dir: .*/loop/run goes through a symbolic link"):
        settings(trainer={"default_local_dir": str(tmp_path / "loop" / "run")})
    assert settings(trainer={"default_local_dir": str(tmp_path / "new" / "run")})  # absent is fine: it is made


def test_the_identity_a_checkpoint_records_names_what_a_run_cannot_change():
    one = settings(trainer={"schedule": "sync"})
    other = settings(trainer={"schedule": "one_step_off", "total_training_steps": 9})
    assert one.identity()["trainer.schedule"] == "sync"
    changed = {key for key in one.identity() if one.identity()[key] != other.identity()[key]}
    assert changed == {"trainer.schedule"}  # the length of a run may change when it resumes
