"""``trainer.schedule=one_step_off`` on the embedded default: the ordering verl specifies, read
back from the run's own metrics and profile."""

import json

import pytest
from training import metrics, overrides, train

ONE_STEP_OFF = (
    "trainer.schedule=one_step_off",
    "trainer.total_training_steps=4",
    "trainer.test_freq=-1",
    "trainer.resume_mode=disable",
)


def spans(profile, worker: str) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(profile.glob(f"*/worker_{worker}.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_batches_train_exactly_one_update_stale_with_one_weight_push_per_step(ray_session, task_dir, tmp_path):
    profile = tmp_path / "profile"
    train(task_dir, tmp_path, *ONE_STEP_OFF, "profiling.enable=true", f"profiling.dir={profile}")
    rows = metrics(tmp_path / "run")
    # Batch 1 comes from the starting weights; every later one from the weights one update back.
    assert [row["training/staleness"] for row in rows] == [0, 1, 1, 1]
    for row in rows:
        assert {
            "timing_s/gen",
            "timing_s/generate_async",
            "timing_s/sync_rollout_weights",
            "timing_s/step",
        } <= row.keys()
        assert "timing_s/update_weights" not in row
        assert "timing_s/old_log_prob" not in row  # bypass: the rollout log-probs are the old ones
        assert row["timing_s/gen"] <= row["timing_s/generate_async"] + 0.05  # only the part not overlapped

    pushes = [s for s in spans(profile, "-1") if s["event"] == "weight_sync"]
    assert len(pushes) == 1 + len(rows)  # one before the loop, then exactly one per step
    rollouts = [s for s in spans(profile, "0") if s["event"] == "rollout"]
    assert len(rollouts) == len(rows)
    for push in pushes:  # never while a generation runs
        end = push["start"] + push["duration_sec"]
        assert all(end <= r["start"] or push["start"] >= r["start"] + r["duration_sec"] for r in rollouts)


def test_generation_overlaps_training(ray_session, task_dir, tmp_path):
    train(task_dir, tmp_path, *ONE_STEP_OFF)
    rows = metrics(tmp_path / "run")[1:]  # step 1 waits for its whole generation
    waited = sum(row["timing_s/gen"] for row in rows)
    generated = sum(row["timing_s/generate_async"] for row in rows)
    assert waited < 0.5 * generated


def test_a_cached_run_loads_every_batch_instead_of_generating(ray_session, task_dir, tmp_path):
    cached = (*ONE_STEP_OFF, "skip.rollout.enable=true", "skip.rollout.steps=[1,2,3,4]")
    first, _ = train(task_dir, tmp_path, *cached)
    scores = [row["critic/score/mean"] for row in metrics(tmp_path / "run")]
    again, _ = train(task_dir, tmp_path, *cached)
    assert first.rollout.calls == 4 and again.rollout.calls == 0
    assert [row["critic/score/mean"] for row in metrics(tmp_path / "run")] == scores


def test_without_bypass_old_log_probs_are_recomputed_and_importance_weighted(ray_session, task_dir, tmp_path):
    train(
        task_dir,
        tmp_path,
        *ONE_STEP_OFF,
        "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is=token",
    )
    for row in metrics(tmp_path / "run"):
        assert "timing_s/old_log_prob" in row and "training/rollout_probs_diff_mean" in row
        assert (
            row["rollout_corr/rollout_is_min"]
            <= row["rollout_corr/rollout_is_mean"]
            <= row["rollout_corr/rollout_is_max"]
        )
        assert 0 <= row["rollout_corr/rollout_is_truncated_frac"] <= 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("resources.actor.cpus=2", "resources.actor: the actor pool needs 1 x 2 CPU"),
        ("algorithm.rollout_correction.rollout_is=tokens", "algorithm.rollout_correction.rollout_is"),
        ("resources.rollout.gpus=1", "resources.rollout.gpus: unknown key"),
    ],
)
def test_bad_config_fails_before_the_first_step_naming_the_key(ray_session, task_dir, tmp_path, override, message):
    from click.testing import CliRunner
    from skip_core.cli import cli
    from skiptests import CONFIGS

    result = CliRunner().invoke(
        cli, ["run", "--config-dir", str(CONFIGS), *overrides(task_dir, tmp_path, *ONE_STEP_OFF, override)]
    )
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
