"""verl's learning-rate schedule (``actor.optim`` / ``critic.optim``): the factor by hand from
verl's formula, the settings' verl semantics, the workers' lr update by update, and resume."""

import copy
import math

import pytest
import torch
from batches import ROWS, padded_batch
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_plugin_trainer.config.algorithm import ActorConfig, CriticConfig, Optim
from skip_plugin_trainer.config.settings import RunSettings
from skip_plugin_trainer.train.checkpoint import CheckpointManager
from skip_plugin_trainer.train.critic import Critic
from skip_plugin_trainer.train.lr_schedule import lr_factor, warmup_steps
from skip_plugin_trainer.train.phases import actor_updates
from skip_plugin_trainer.train.policy import Policy

LR = 1e-3

# -- the factor, against verl's formula worked by hand --------------------------------------


def test_constant_with_warmup_rises_linearly_from_zero_then_holds():
    optim = Optim(lr_warmup_steps=4)
    assert [lr_factor(optim, None, k) for k in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_constant_without_warmup_is_one_from_the_first_update():
    assert [lr_factor(Optim(), None, k) for k in (0, 1, 99)] == [1.0, 1.0, 1.0]


def test_cosine_decays_from_lr_to_min_lr_ratio():
    """Warm-up 2 of 10 steps, floor 0.1: after the warm-up, 0.55 + 0.45 cos(pi (k - 2) / 8)."""
    optim = Optim(lr_scheduler_type="cosine", lr_warmup_steps=2, min_lr_ratio=0.1)
    assert lr_factor(optim, 10, 0) == 0.0  # step 0: the first update trains at lr 0, as in verl
    assert lr_factor(optim, 10, 1) == 0.5
    assert lr_factor(optim, 10, 2) == pytest.approx(1.0)  # the warm-up's end: cos 0
    assert lr_factor(optim, 10, 6) == pytest.approx(0.55)  # halfway: cos(pi / 2) = 0
    assert lr_factor(optim, 10, 9) == pytest.approx(0.55 - 0.45 * math.cos(math.pi / 8))  # the last update
    assert lr_factor(optim, 10, 10) == pytest.approx(0.1)  # the floor, where a next step would be


def test_cosine_with_a_whole_cycle_comes_back_up_and_never_dips_below_the_floor():
    optim = Optim(lr_scheduler_type="cosine", num_cycles=1.0, min_lr_ratio=0.2)
    assert lr_factor(optim, 8, 0) == pytest.approx(1.0)
    assert lr_factor(optim, 8, 4) == pytest.approx(0.2)  # cos(pi) = -1: 0.6 - 0.4
    assert lr_factor(optim, 8, 8) == pytest.approx(1.0)
    assert min(lr_factor(optim, 8, k) for k in range(9)) >= 0.2


@pytest.mark.parametrize(
    ("steps", "ratio", "total", "expected"),
    [
        (-1, 0.25, 10, 2),  # int(2.5): rounded down, as verl's int()
        (0, 0.25, 10, 2),  # verl takes the ratio for any steps <= 0
        (3, 0.25, 10, 3),  # positive steps win over the ratio
        (-1, 0.0, None, 0),
    ],
)
def test_warmup_steps_come_from_the_ratio_of_the_runs_steps_unless_given(steps, ratio, total, expected):
    assert warmup_steps(Optim(lr_warmup_steps=steps, lr_warmup_steps_ratio=ratio), total) == expected


def test_a_schedule_that_needs_the_runs_steps_says_so():
    with pytest.raises(ValueError, match="lr_warmup_steps_ratio needs the run's total training steps"):
        warmup_steps(Optim(lr_warmup_steps_ratio=0.1), None)
    with pytest.raises(ValueError, match="lr_scheduler_type=cosine needs the run's total training steps"):
        lr_factor(Optim(lr_scheduler_type="cosine"), None, 0)


def test_actor_updates_skip_the_critic_warmup_steps():
    assert [actor_updates(5, warmup) for warmup in (0, 1, 2, 5, 6, 9)] == [5, 5, 4, 1, 0, 0]


# -- the settings, as verl's optimizer config --------------------------------------------------


def settings(**optim) -> RunSettings:
    return RunSettings.from_config({"task": {"name": None}, "actor": {"optim": optim}})


def test_warmup_style_is_the_deprecated_name_and_wins_as_in_verl():
    assert settings(warmup_style="cosine").actor.optim.lr_scheduler_type == "cosine"
    assert settings(warmup_style="cosine", lr_scheduler_type="constant").actor.optim.lr_scheduler_type == "cosine"
    assert settings(min_lr_ratio=None, lr_warmup_steps=None).actor.optim == Optim()  # verl's null: the default


@pytest.mark.parametrize(
    ("optim", "message"),
    [
        ({"warmup_style": "linear"}, r"^actor\.optim\.warmup_style: expected 'constant' or 'cosine', got 'linear'$"),
        ({"lr_scheduler_type": "wsd"}, r"^actor\.optim\.lr_scheduler_type: expected 'constant' or 'cosine'"),
        ({"min_lr_ratio": 1.5}, r"^actor\.optim\.min_lr_ratio: expected a number <= 1\.0, got 1\.5$"),
        ({"lr_warmup_steps": -2}, r"^actor\.optim\.lr_warmup_steps: expected an integer >= -1, got -2$"),
        ({"lr_warmup_steps_ratio": 2}, r"^actor\.optim\.lr_warmup_steps_ratio: expected a number <= 1\.0, got 2$"),
    ],
)
def test_values_verl_refuses_fail_in_one_line(optim, message):
    with pytest.raises(ConfigError, match=message):
        settings(**optim)


# -- the workers ---------------------------------------------------------------------------

SCHEDULE = Optim(lr=LR, lr_scheduler_type="cosine", lr_warmup_steps=2, min_lr_ratio=0.1)
TOTAL = 6


def policy(model_dir, optim: Optim = SCHEDULE) -> Policy:
    config = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size=1, ppo_epochs=2, optim=optim)
    return Policy(str(model_dir), config, samples_per_prompt=1, total_training_steps=TOTAL)


def training_batch(worker: Policy) -> Batch:
    batch = padded_batch(ROWS)
    batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
    batch.batch["advantages"] = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.batch["response_mask"]
    return batch


def test_the_actor_trains_each_update_at_the_scheduled_lr_however_many_mini_batches(tiny_model_dir):
    """Three mini-batches x two epochs an update, one scheduler step: update k trains at lr x factor(k)."""
    worker = policy(tiny_model_dir)
    batch = training_batch(worker)
    lrs = [worker.update(batch)["actor/lr"] for _ in range(4)]
    hand = [0.0, 0.5, 1.0, 0.55 + 0.45 * math.cos(math.pi / 4)]  # warm-up 2, then cosine over 4 steps
    assert lrs == pytest.approx([LR * f for f in hand], rel=1e-12, abs=0)
    assert lrs == [LR * lr_factor(SCHEDULE, TOTAL, k) for k in range(4)]
    assert worker.optimizer.param_groups[0]["lr"] == LR * lr_factor(SCHEDULE, TOTAL, 4)  # the next update's


def test_an_update_at_lr_zero_leaves_the_weights_as_they_were(tiny_model_dir):
    worker = policy(tiny_model_dir)
    before = [p.detach().clone() for p in worker.model.parameters()]
    assert worker.update(training_batch(worker))["actor/lr"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, worker.model.parameters(), strict=True))


def test_a_resumed_actor_continues_the_schedule_where_the_checkpoint_stopped(tiny_model_dir, tmp_path):
    """The state after 3 updates, through a real checkpoint, in a fresh policy: update 4 trains at
    the uninterrupted run's lr, to the same weights."""
    uninterrupted = policy(tiny_model_dir)
    batch = training_batch(uninterrupted)
    for _ in range(3):
        uninterrupted.update(batch)
    manager = CheckpointManager(tmp_path)
    manager.save(
        3, {"global_steps": 3}, {}, lambda directory: {"actor": uninterrupted.save_shards(str(directory / "actor"))}
    )
    saved = manager.load(3)

    resumed = policy(tiny_model_dir)
    updates = actor_updates(3, critic_warmup=0)
    resumed.load_shards(str(saved.path / "actor"), saved.shards["actor"], updates=updates)
    expected = uninterrupted.update(batch)["actor/lr"]
    assert expected == LR * lr_factor(SCHEDULE, TOTAL, 3) > 0
    assert resumed.update(batch)["actor/lr"] == expected
    for a, b in zip(uninterrupted.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_saved_before_schedules_resumes_onto_the_schedule(tiny_model_dir):
    """A checkpoint older than schedules (format 1, one process's state dicts) holds param groups
    without ``initial_lr``: its constant lr is the base."""
    old = policy(tiny_model_dir, Optim(lr=LR))
    old.update(training_batch(old))
    model, optimizer = old.model.state_dict(), copy.deepcopy(old.optimizer.state_dict())
    for group in optimizer["param_groups"]:
        del group["initial_lr"]
    resumed = policy(tiny_model_dir)
    resumed.load_full_state(model, optimizer, updates=1)
    assert resumed.update(training_batch(resumed))["actor/lr"] == LR * 0.5


def test_the_critic_follows_and_resumes_the_same_schedule(tiny_model_dir, tmp_path):
    def critic() -> Critic:
        config = CriticConfig(ppo_mini_batch_size=3, ppo_micro_batch_size=3, optim=SCHEDULE)
        return Critic(str(tiny_model_dir), config, samples_per_prompt=1, total_training_steps=TOTAL)

    worker = critic()
    batch = padded_batch(ROWS)
    batch.batch["returns"] = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.batch["response_mask"]
    batch.batch["values"] = worker.compute_values(batch).batch["values"]
    assert [worker.update(batch)["critic/lr"] for _ in range(3)] == [
        LR * lr_factor(SCHEDULE, TOTAL, k) for k in range(3)
    ]
    resumed = critic()
    resumed.load_shards(str(tmp_path), worker.save_shards(str(tmp_path)), updates=3)
    assert resumed.update(batch)["critic/lr"] == worker.update(batch)["critic/lr"] == LR * lr_factor(SCHEDULE, TOTAL, 3)
