"""GAE-PPO end to end: the critic's phases under every schedule, its warm-up, and its state
carried through a checkpoint."""

import pytest
from training import metrics, train

GAE = ("algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-4", "trainer.critic_warmup=2")
CRITIC = ("critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size=2")


def gae_run(task_dir, tmp_path, *more, steps: int = 2) -> list[dict]:
    train(task_dir, tmp_path, *GAE, *CRITIC, f"trainer.total_training_steps={steps}", *more)
    return metrics(tmp_path / "run")


@pytest.fixture(scope="module")
def sync_rows(ray_session, task_dir, tmp_path_factory) -> list[dict]:
    return gae_run(task_dir, tmp_path_factory.mktemp("gae-sync"), "trainer.save_freq=1")


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "fully_async"])
def test_the_critic_trains_every_step_and_the_actor_after_its_warmup(
    sync_rows, ray_session, task_dir, tmp_path, schedule
):
    rows = sync_rows if schedule == "sync" else gae_run(task_dir, tmp_path, f"trainer.schedule={schedule}")
    first, second = (row for row in rows if row["step"] > 0)
    for row in (first, second):
        assert {"timing_s/values", "timing_s/update_critic", "critic/vf_loss", "critic/vf_explained_var"} <= set(row)
        assert row["critic/returns/max"] <= 1.0 + 1e-5  # the task's score is 0 or 1, with gamma 1
    assert "actor/pg_loss" not in first and "timing_s/update_actor" not in first  # trainer.critic_warmup=2
    assert "actor/pg_loss" in second


def test_a_resumed_run_continues_the_critic_it_saved(sync_rows, ray_session, task_dir, tmp_path):
    gae_run(task_dir, tmp_path, "trainer.save_freq=1", steps=1)
    resumed = [row for row in gae_run(task_dir, tmp_path, "trainer.save_freq=1") if row["step"] == 2]
    uninterrupted = [row for row in sync_rows if row["step"] == 2]
    for key in ("critic/values/mean", "critic/vf_loss", "actor/pg_loss"):  # a fresh critic would differ
        assert resumed[-1][key] == pytest.approx(uninterrupted[-1][key], rel=1e-4, abs=1e-7), key
