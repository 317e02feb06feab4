"""GAE-PPO end to end: the critic's phases under every schedule, its warm-up, and its state
carried through a checkpoint, and every phase of it replayed from the cache."""

import json

import pytest
from training import metrics, train

pytestmark = pytest.mark.integration  # runs with a critic under every schedule

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


ROLES = ("rollout", "reward", "old_log_prob", "values")


def cached(cache) -> list[str]:
    return [f"skip.{r}.{k}" for r in ROLES for k in ("enable=true", "steps=[1,2]", f"dump_dir={cache}")]


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_run_with_every_role_cached_replays_the_first_runs_metrics(ray_session, task_dir, tmp_path, estimator):
    """Rollouts, rewards, old log-probs and (gae) values from the cache: every loss and statistic of the
    updates is the first run's, and the profile shows each role hit on each step."""
    cache, estimate = tmp_path / "cache", f"algorithm.adv_estimator={estimator}"
    first = gae_run(task_dir, tmp_path / "first", *cached(cache), estimate)
    profile = ("profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}")
    replayed = gae_run(task_dir, tmp_path / "replayed", *cached(cache), *profile, estimate)
    keys = [k for k in first[-1] if k.startswith(("critic/", "actor/", "response_length/")) and k != "actor/lr"]
    assert {"critic/advantages/mean", "actor/pg_loss", "actor/entropy"} <= set(keys)
    roles = ROLES if estimator == "gae" else ROLES[:3]
    for a, b in zip(first, replayed, strict=True):
        for key in (k for k in keys if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    lookups = [
        (event["extra"]["role"], event["step"], event["extra"]["cache"])
        for path in sorted((tmp_path / "profile").glob("step_*/worker_-1.jsonl"))
        for event in map(json.loads, path.read_text().splitlines())
        if event["event"] == "skip_lookup"
    ]
    assert sorted(lookups) == sorted((role, step, "hit") for role in roles for step in (1, 2))
