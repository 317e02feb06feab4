"""DAPO: dynamic sampling (``algorithm.filter_groups``) on hand-made groups and end to end, with
each generation of a step cached as its own entry and replayed exactly."""

import json

import numpy as np
import pytest
import torch
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_plugin_trainer.config.algorithm import FilterGroups
from skip_plugin_trainer.train.dynamic_sampling import fill, varied_groups
from training import metrics, train

pytestmark = pytest.mark.integration  # DAPO runs under every schedule


def groups(scores: list[list[float]], first_uid: int = 0) -> Batch:
    """One group per inner list: its samples' scores."""
    uids = [f"u{first_uid + g}" for g, group in enumerate(scores) for _ in group]
    flat = [s for group in scores for s in group]
    return Batch({"token_level_scores": torch.tensor(flat)[:, None]}, {"uid": np.array(uids), "score": np.array(flat)})


def test_a_group_is_kept_when_its_scores_vary_or_it_has_one_sample():
    kept = varied_groups(groups([[1.0, 0.0], [1.0, 1.0], [0.0], [0.5, 0.5, 0.25]]), "acc")
    assert kept.tolist() == [True, True, False, False, True, True, True, True]


def test_more_generations_fill_the_batch_then_it_is_cut_to_size():
    later = {1: groups([[0.0, 0.0], [1.0, 0.0]], first_uid=10), 2: groups([[1.0, 0.0], [0.0, 1.0]], first_uid=20)}
    asked = []

    def generate(index):
        asked.append(index)
        return later[index]

    batch, found = fill(
        groups([[1.0, 1.0], [0.0, 1.0]]),
        FilterGroups(enable=True),
        prompts_wanted=3,
        samples_per_prompt=2,
        score=lambda batch: None,
        generate=generate,
        step=1,
    )
    assert asked == [1, 2] and len(batch) == 6
    assert batch.non_tensor_batch["uid"].tolist() == ["u1", "u1", "u11", "u11", "u20", "u20"]
    assert found == {"train/num_gen_batches": 3.0, "train/num_filtered_prompts": 2.0, "train/num_kept_prompts": 4.0}


def test_too_many_generations_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.max_num_gen_batches: 2 generations of step 7"):
        fill(
            groups([[1.0, 1.0]]),
            FilterGroups(enable=True, max_num_gen_batches=2),
            prompts_wanted=1,
            samples_per_prompt=2,
            score=lambda batch: None,
            generate=lambda index: groups([[0.0, 0.0]], first_uid=index),
            step=7,
        )


# The tests' tiny model scores 0 on every prompt, so the task's score never varies; DAPO's
# overlong penalty does: a response past 64 - 24 tokens loses reward in proportion.
DAPO = (
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=seq_reward",
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.len=24",
    "trainer.total_training_steps=2",
)
ROLES = ("rollout", "reward")


def cached(cache) -> list[str]:
    return [f"skip.{r}.{k}" for r in ROLES for k in ("enable=true", "steps=[1,2]", f"dump_dir={cache}")]


def test_a_dapo_run_with_its_generations_cached_replays_exactly(ray_session, task_dir, tmp_path):
    cache = tmp_path / "cache"
    train(task_dir, tmp_path / "first", *DAPO, *cached(cache))
    first = [row for row in metrics(tmp_path / "first" / "run") if row["step"] > 0]
    generations = [int(row["train/num_gen_batches"]) for row in first]
    assert max(generations) > 1 and all(row["train/num_kept_prompts"] >= 4 for row in first)
    profile = ("profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}")
    trainer, _ = train(task_dir, tmp_path / "replayed", *DAPO, *cached(cache), *profile)
    replayed = [row for row in metrics(tmp_path / "replayed" / "run") if row["step"] > 0]
    assert trainer.rollout.calls == 1  # validation only: every generation of both steps came from the cache
    for a, b in zip(first, replayed, strict=True):
        for key in ("train/num_gen_batches", "train/num_kept_prompts", "critic/score/mean", "actor/pg_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    lookups = [
        (event["extra"]["role"], event["step"], event["extra"]["cache"])
        for path in sorted((tmp_path / "profile").glob("step_*/worker_-1.jsonl"))
        for event in map(json.loads, path.read_text().splitlines())
        if event["event"] == "skip_lookup"
    ]
    expected = [
        (role, step, "hit") for role in ROLES for step, n in zip((1, 2), generations, strict=True) for _ in range(n)
    ]
    assert sorted(lookups) == sorted(expected)


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_dynamic_sampling_runs_under_the_overlapped_schedules(ray_session, task_dir, tmp_path, schedule):
    train(task_dir, tmp_path, *DAPO, f"trainer.schedule={schedule}")
    rows = [row for row in metrics(tmp_path / "run") if row["step"] > 0]
    assert len(rows) == 2 and all(row["train/num_kept_prompts"] >= 4 for row in rows)


def test_a_task_whose_scores_never_vary_stops_at_max_num_gen_batches(ray_session, task_dir, tmp_path):
    limit = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2")
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.max_num_gen_batches: 2 generations of step 1"):
        train(task_dir, tmp_path, *limit, "trainer.total_training_steps=1")
