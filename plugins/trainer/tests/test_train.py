"""``skip run`` end to end on Ray with the embedded tiny model: training, the rollout cache,
checkpoints, and the checks that fail before the first step (resume after SIGKILL:
tests/test_resume.py)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from skip_core import ConfigError, encoding
from skip_core.cli import cli
from skip_core.entries import scan, verify
from skip_core.schedule import GEN, GLOBAL_STEPS, GREEDY, STEP, WEIGHT_SYNC
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.data import generation_inputs
from skip_plugin_trainer.train.trainer import Trainer
from skiptests import CONFIGS
from training import metrics, overrides, train, undeclared_phases

# The 5-step test model scores 0 everywhere, so advantages are 0: the entropy bonus and the KL
# loss (with its reference model) give the update something to do. Both the rollouts and the
# reference log-probs of the two steps are cached.
KL_RUN = (
    "trainer.total_training_steps=2",
    "trainer.save_freq=1",
    "trainer.test_freq=2",
    "actor.entropy_coeff=0.01",
    "actor.use_kl_loss=true",
    "skip.rollout.enable=true",
    "skip.ref_log_prob.enable=true",
    "skip.ref_log_prob.steps=[1,2]",
)


@dataclass
class Run:
    directory: Path
    trainer: Any
    output: str
    rows: list[dict]


def kl_run(task_dir, directory: Path, cache: Path, *more) -> Run:
    """``KL_RUN`` in ``directory``, both roles caching in ``cache`` (beside each other: roles never collide)."""
    roles = (f"skip.rollout.dump_dir={cache}", f"skip.ref_log_prob.dump_dir={cache}")
    trainer, output = train(task_dir, directory, *KL_RUN, *roles, *more)
    return Run(directory, trainer, output, metrics(directory / "run"))


@pytest.fixture(scope="module")
def first(ray_session, task_dir, tmp_path_factory) -> Run:
    """The two steps, generating and caching; shared by the tests that read or replay them."""
    directory = tmp_path_factory.mktemp("first")
    return kl_run(task_dir, directory, directory / "cache")


@pytest.fixture(scope="module")
def replayed(first, task_dir, tmp_path_factory) -> Run:
    """The same two steps in a run directory of their own, every rollout and reference log-prob
    loaded from ``first``'s cache; profiled."""
    directory = tmp_path_factory.mktemp("replayed")
    profile = ("profiling.enable=true", f"profiling.dir={directory / 'profile'}")
    return kl_run(task_dir, directory, first.directory / "cache", *profile)


def test_two_steps_train_then_the_cache_replays_generation(first, replayed):
    assert first.trainer.rollout.calls == 3  # two training batches and one validation
    rows, run = first.rows, first.directory / "run"
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0 <= row["critic/score/mean"] <= 1 and row["actor/grad_norm"] > 0
        phases = (GEN, "reward", "old_log_prob", "ref", "adv", "update_actor", WEIGHT_SYNC, STEP)
        assert {f"timing_s/{phase}" for phase in phases} <= row.keys()
    assert not undeclared_phases(first.trainer, rows)  # the trainer-schedule contract
    # Step 1's second mini-batch already runs on updated weights: the policy left the reference.
    assert all(row["actor/kl_loss"] > 0 for row in rows)
    assert "val/score/mean" in rows[1] and "val/score/mean" not in rows[0]
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert "skip run" in first.output and "score" in first.output
    entries = [p for p in sorted(scan(first.directory / "cache")) if verify(p)["role"] == "rollout"]
    assert [p.name for p in entries] == ["1", "2"]  # validation is never cached
    assert all(verify(p)["samples"] == 8 for p in entries)

    assert replayed.trainer.rollout.calls == 1  # only validation reached the workers
    for generated, loaded in zip(rows, replayed.rows, strict=True):
        # Same rollouts from the cache and the same start weights: the same first update.
        assert loaded["critic/score/mean"] == generated["critic/score/mean"]
        assert loaded["response_length/mean"] == generated["response_length/mean"]
    assert replayed.rows[0]["actor/pg_loss"] == pytest.approx(rows[0]["actor/pg_loss"], abs=1e-6)


def test_the_ref_log_prob_role_replays_the_reference_exactly(first, replayed):
    """A second role, from plugin_template: replayed reference log-probs give the same KL and losses."""
    roles = sorted((verify(p)["role"], int(p.name)) for p in scan(first.directory / "cache"))
    assert roles == [("ref_log_prob", 1), ("ref_log_prob", 2), ("rollout", 1), ("rollout", 2)]
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm"):
        assert replayed.rows[0][key] == pytest.approx(first.rows[0][key], rel=1e-6, abs=1e-9), key
    lookups = [
        event
        for path in sorted((replayed.directory / "profile").glob("step_*/worker_-1.jsonl"))
        for event in map(json.loads, path.read_text().splitlines())
        if event["event"] == "skip_lookup" and event["extra"].get("role") == "ref_log_prob"
    ]
    assert [(event["step"], event["extra"]["cache"]) for event in lookups] == [(1, "hit"), (2, "hit")]


def test_generate_returns_at_once_and_weights_wait_for_it(ray_session, task_dir, tmp_path):
    """The schedule contract: a generation runs in the background; weights cannot move under it."""
    config = compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, "trainer.resume_mode=disable")))
    trainer = Trainer(config, Console(record=True))
    try:
        trainer.start()
        future = trainer.generate(trainer.prompts(), 1)
        assert not future.done()
        with pytest.raises(RuntimeError, match="a generation is in flight"):
            trainer.sync_weights()
        batch = future.result(timeout=120)
        assert len(batch) == 8 and "responses" in batch.batch  # 4 prompts x rollout.n=2
        assert set(batch.non_tensor_batch["max_weight_version"]) == {0} and batch.meta_info["generate_s"] > 0
        trainer.sync_weights()
    finally:
        trainer.close()


def test_remax_baselines_each_prompt_with_its_greedy_responses_score(ray_session, task_dir, tmp_path):
    """verl's ReMax: a generation adds one greedy response per prompt, from the same weights,
    scored by the reward function; every sample of the prompt gets that score as its baseline."""
    more = ("trainer.resume_mode=disable", "algorithm.adv_estimator=remax")
    trainer = Trainer(compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, *more))), Console())
    try:
        trainer.start()
        prompts = trainer.prompts()
        batch = trainer.generate(prompts.select(), 1).result(timeout=300)
        assert trainer.rollout.calls == 2  # the samples, then the greedy responses
        baselines = batch.batch["reward_baselines"]
        assert baselines.shape == (8,) and torch.equal(baselines[0::2], baselines[1::2])  # rollout.n=2
        rest = prompts.select()
        greedy = generation_inputs(rest)
        greedy.meta_info.update({GLOBAL_STEPS: 1, GREEDY: True})
        again = trainer.rollout.generate_sequences(greedy)
        assert len(again) == 4  # one each, whatever rollout.n says
        scores, _ = trainer.rewarder(rest.union(again))
        torch.testing.assert_close(baselines[0::2], scores.sum(-1))
    finally:
        trainer.close()


def test_a_finished_run_says_so_in_one_line_and_a_changed_one_is_not_resumed(ray_session, task_dir, tmp_path):
    first, _ = train(task_dir, tmp_path, "trainer.total_training_steps=1", "trainer.save_freq=1")
    assert first.global_steps == 1
    second, output = train(task_dir, tmp_path, "trainer.total_training_steps=1", "trainer.save_freq=1")
    (line,) = output.strip().splitlines()
    assert line.startswith("nothing to train: ") and "global_step_1 is step 1 and this run ends at step 1" in line
    assert second.cluster.pools == [] and second.global_steps == 0  # no worker started
    assert [row["step"] for row in metrics(tmp_path / "run")] == [1]

    with pytest.raises(ConfigError) as error:
        train(task_dir, tmp_path, "trainer.total_training_steps=3", "trainer.schedule=one_step_off", "rollout.n=4")
    message = str(error.value)
    assert message.startswith("trainer.resume_mode: the checkpoint ") and "global_step_1" in message
    assert "rollout.n (2 there, 4 here), trainer.schedule ('sync' there, 'one_step_off' here)" in message
    assert message.endswith("(trainer.default_local_dir=...) or start over here (trainer.resume_mode=disable)")


def test_two_rollout_workers_sample_what_one_samples(first, task_dir, tmp_path):
    """Each worker seeds its rows by their index in the whole batch, so the split changes nothing:
    step 1 of ``first`` (one worker; its updates come after) against a run with two."""
    two, _ = train(
        task_dir,
        tmp_path,
        "trainer.total_training_steps=1",
        "skip.rollout.enable=true",
        "resources.rollout.workers=2",
        "resources.rollout.cpus_per_worker=0.5",
    )
    assert two.rollout.calls == 2 and len(two.rollout.workers) == 2  # the step and the final validation
    (two_entry,) = scan(tmp_path / "cache")
    (one_entry,) = [p for p in scan(first.directory / "cache") if verify(p)["role"] == "rollout" and p.name == "1"]
    one_batch, two_batch = encoding.read(one_entry), encoding.read(two_entry)
    assert torch.equal(one_batch.batch["responses"], two_batch.batch["responses"])
    assert two_batch.meta_info["rollout"]["requests"] == 8


def test_a_run_syncing_over_the_weight_group_is_the_run_syncing_through_the_object_store(first, task_dir, tmp_path):
    """``first`` syncs through the object store (``rollout.weight_sync=auto`` on CPUs): the same
    steps synced over a gloo group sample and train alike, step 2 from step 1's weights (an engine
    that kept its own would sample with probabilities 1e-3 apart from the trainer's)."""
    assert "weight sync: through Ray's object store (rollout.weight_sync=auto: the actor or the engines" in first.output
    other = kl_run(task_dir, tmp_path, tmp_path / "cache", "rollout.weight_sync=group")
    assert "weight sync: over a gloo process group (rollout.weight_sync=group: the hf engines join it" in other.output
    assert first.trainer.rollout.group_sync is None and other.trainer.rollout.group_sync.formed == 1
    assert [row["step"] for row in other.rows] == [row["step"] for row in first.rows] == [1, 2]
    for objects, group in zip(first.rows, other.rows, strict=True):
        assert group["response_length/mean"] == objects["response_length/mean"]
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "training/rollout_probs_diff_mean"):
            assert group[key] == pytest.approx(objects[key], rel=1e-6, abs=1e-9), (group["step"], key)
        assert group["training/rollout_probs_diff_max"] < 1e-4


def cli_run(*args):
    return CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *args], catch_exceptions=False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_files=[/nonexistent/train.parquet]", "data.train_files: no such file"),
        ("model.path=/nonexistent/model", "model.path: expected a local Hugging Face model directory"),
        ("data.max_prompt_length=8", "data.max_prompt_length: all 64 prompts are longer than 8 tokens"),
        ("actor.ppo_mini_batch_size=3", "actor.ppo_mini_batch_size: 3 prompts do not divide data.train_batch_size=4"),
        ("actor.ppo_micro_batch_size=3", "actor.ppo_micro_batch_size: 3 samples do not divide a mini-batch of 2"),
        ("trainer.schedule=mine", "trainer.schedule: unknown schedule 'mine' (installed: "),
        ("reward.function=mine", "reward.function: unknown reward function 'mine' (installed: task)"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
        ("trainer.logger=[console,mlflow]", "trainer.logger[1]: expected 'console', 'jsonl', 'tensorboard' or 'wandb'"),
        ("trainer.resume_mode=resume_path", "trainer.resume_from_path: required"),
        ("resources.rollout.workers=3", "resources.rollout.workers: 3 workers cannot split data.train_batch_size=4"),
        ("data.train_batch_size=0", "data.train_batch_size: 0 is fully-async's (prompts stream one by one)"),
        ("data.train_batch_size=-1", "data.train_batch_size: expected an integer > 0, got -1"),
        ("data.shuffle=maybe", "data.shuffle: expected true or false, got 'maybe'"),
        ("task.warmup_steps=-1", "task.warmup_steps: expected an integer >= 0, got -1"),
        ("task.name=chess", "task.name: unknown task 'chess' (installed: arithmetic)"),
        ("rollout.backend=tgi", "rollout.backend: unknown backend 'tgi' (installed: hf, "),
        ("rollout.top_p=2", "rollout.top_p"),
    ],
)
@pytest.mark.loaded
def test_bad_input_fails_before_the_first_step(task_dir, tmp_path, monkeypatch, override, message):
    started = []  # Trainer.start joins Ray, places the pools and loads the model: none of it may happen
    start = Trainer.start
    monkeypatch.setattr(Trainer, "start", lambda self: (started.append(self), start(self))[-1])
    result = cli_run(*overrides(task_dir, tmp_path, override))
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
    assert started == []  # it failed in the checks, before anything started


def test_unknown_tool_fails_before_the_first_step(task_dir, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: abacus\n")
    result = cli_run(*overrides(task_dir, tmp_path, f"rollout.multi_turn.tools_config={tools}"))
    assert result.exit_code != 0 and "abacus" in result.output, result.output
