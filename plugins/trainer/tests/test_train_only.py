"""Rollout-only and train-only: ``skip rollout steps=1..3`` fills the cache with the steps ``skip run``
would generate, and a run whose every generation is cached starts no rollout engine, until a
generation the cache cannot serve starts it with the weights of the last sync."""

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from safetensors.torch import load_file
from skip_core import encoding
from skip_core.caching import PromptMismatchError
from skip_core.cli import cli
from skip_core.manager import SkipManager
from skip_plugin_arithmetic.calculator import evaluate
from skip_plugin_arithmetic.task import expression_of, score
from skip_plugin_trainer.commands import compose_config
from skip_plugin_trainer.train.checkpoint_files import Checkpoint
from skip_plugin_trainer.train.train_only import plan_engines
from skip_plugin_trainer.train.trainer import Trainer
from skiptests import CONFIGS
from training import metrics, overrides, train

pytestmark = pytest.mark.integration  # rollout-only, then train-only runs

STEPS = 3
NO_VALIDATION = ("trainer.test_freq=0", f"trainer.total_training_steps={STEPS}")


def cached(cache: Path) -> tuple[str, ...]:
    return ("skip.rollout.enable=true", f"skip.rollout.dump_dir={cache}")


@pytest.fixture(scope="module")
def filled(task_dir, tmp_path_factory) -> Path:
    """A cache ``skip rollout`` filled with steps 1-3 of the tests' run; tests copy it to change it."""
    root = tmp_path_factory.mktemp("filled")
    args = ["rollout", "--config-dir", str(CONFIGS), *overrides(task_dir, root), *cached(root / "cache")]
    result = CliRunner().invoke(cli, [*args, f"steps=1..{STEPS}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (root / "rollout.txt").write_text(result.output)  # its summary, which a test checks against the cache
    assert [line.split(":")[0] for line in result.output.splitlines() if line.startswith("step ")] == [
        "step 1",
        "step 2",
        "step 3",
    ]
    return root / "cache"


def store(cache: Path) -> Path:
    (directory,) = cache.glob("*/GBS*")
    return directory


def trainer(task_dir, tmp_path, *more) -> Trainer:
    """A trainer checked and ready to start, with no worker placed: what ``plan_engines`` sees."""
    config = compose_config(CONFIGS, "run", tuple(overrides(task_dir, tmp_path, *more)))
    return Trainer(config, Console(record=True, width=200))


def plan(task_dir, tmp_path, cache, *more, resume_from=None):
    t = trainer(task_dir, tmp_path, *cached(cache), *NO_VALIDATION, *more)
    try:
        return plan_engines(t.settings, t.schedule, t.loader, resume_from, t.total_steps, t.val_set is not None)
    finally:
        t.close()
        SkipManager.reset()


def test_rollout_only_writes_each_step_and_logs_it_beside_the_cache(filled):
    directory = store(filled)
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [1, 2, 3]
    log = (directory / "skip_rollout.log").read_text().splitlines()
    assert [line.split()[2] for line in log] == ["1:", "2:", "3:"] and all("(version 0)" in line for line in log)
    for step in (1, 2, 3):  # each sample records the weights that generated it: the starting ones
        samples = encoding.read(directory / str(step)).non_tensor_batch
        assert set(samples["min_weight_version"]) == set(samples["max_weight_version"]) == {0}


def test_the_summary_of_several_steps_adds_up_their_cache_entries(task_dir, filled):
    """The summary is added up step by step (no step's batch is kept to the end): it must say
    what the three entries hold together, and score them as the reward function does."""
    from transformers import AutoTokenizer

    entries = [encoding.read(store(filled) / str(step)) for step in range(1, STEPS + 1)]
    stats = [entry.meta_info["rollout"] for entry in entries]
    turns = np.concatenate([entry.non_tensor_batch["num_turns"] for entry in entries])
    reasons = Counter(r for entry in entries for r in entry.non_tensor_batch["finish_reason"])
    tokenizer = AutoTokenizer.from_pretrained(task_dir / "model")
    scores = [  # the reward function's: the response's tokens decoded, against the question's answer
        score(tokenizer.decode(response, skip_special_tokens=True), evaluate(expression_of(messages[0]["content"])))
        for entry in entries
        for response, messages in zip(entry.batch["responses"], entry.non_tensor_batch["messages"], strict=True)
    ]
    tokens = sum(s["generated_tokens"] for s in stats)
    samples = sum(len(entry) for entry in entries)
    rows = {row[0]: row[1] for row in _table(filled.parent / "rollout.txt")}
    assert rows["steps of skip run"] == f"1..{STEPS}, with the starting weights (model.path)"
    assert rows["prompts × samples"] == f"{samples // 2} × 2 = {samples} requests"  # rollout.n=2
    assert rows["generation"].startswith(f"{tokens} tokens in ")
    assert rows["tokens/s"] == f"{tokens / sum(s['seconds'] for s in stats):.1f}"
    assert rows["turns per request"] == f"mean {turns.mean():.2f}, max {turns.max()}"
    assert rows["tool calls"] == str(sum(int(entry.non_tensor_batch["tool_calls"].sum()) for entry in entries))
    assert rows["finish reasons"] == ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items()))
    assert rows["task score (mean)"] == f"{np.mean(scores):.3f}"


def _table(path: Path) -> list[list[str]]:
    """The rows of the summary table ``skip rollout`` printed, as [label, value]."""
    lines = path.read_text().splitlines()
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]


def test_every_step_cached_and_no_validation_defers_the_engines(task_dir, tmp_path, filled):
    found = plan(task_dir, tmp_path, filled)
    assert found.deferred and found.line.startswith("train-only: every generation of steps 1-3 is in the skip cache")


def test_validation_keeps_the_engines_and_says_so(task_dir, tmp_path, filled):
    found = plan(task_dir, tmp_path, filled, "trainer.test_freq=2")
    assert not found.deferred and "validation generates (trainer.test_freq=2)" in found.line


@pytest.mark.parametrize(
    "more",
    [
        (f"trainer.total_training_steps={STEPS + 1}",),  # step 4 is not cached
        # Other prompts at every step: their fingerprints differ, which these policies refuse.
        ("data.seed=7", "skip.rollout.on_prompt_mismatch=regenerate"),
        ("trainer.schedule=fully_async",),  # streams samples: the async_rollout role
        ("algorithm.filter_groups.enable=true",),  # draws prompts the rewards decide
    ],
    ids=["a step missing", "other prompts, regenerate", "fully_async", "dynamic sampling"],
)
def test_a_run_the_cache_does_not_cover_starts_its_engines_quietly(task_dir, tmp_path, filled, more):
    assert plan(task_dir, tmp_path, filled, *more).line is None
    assert not plan(task_dir, tmp_path, filled, *more).deferred


def test_other_prompts_under_on_prompt_mismatch_error_stop_the_run_before_it_starts(task_dir, tmp_path, filled):
    with pytest.raises(PromptMismatchError, match=r"skip\.rollout\.on_prompt_mismatch=error"):
        plan(task_dir, tmp_path, filled, "data.seed=7", "skip.rollout.on_prompt_mismatch=error")


def test_a_corrupt_entry_keeps_the_engines(task_dir, tmp_path, filled):
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    (tensors,) = (store(cache) / "2").glob("*.safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-8] + b"corrupt!")
    assert not plan(task_dir, tmp_path, cache).deferred


def test_a_resumed_run_needs_only_the_steps_after_its_checkpoint(task_dir, tmp_path, filled):
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    shutil.rmtree(store(cache) / "1")
    shutil.rmtree(store(cache) / "2")
    t = trainer(task_dir, tmp_path, *NO_VALIDATION)
    t.loader.seek(2)  # where a run checkpointed after step 2 resumes
    checkpoint = Checkpoint(step=2, trainer={"loader": t.loader.state_dict()}, rng={}, path=tmp_path, shards={})
    t.close()
    assert plan(task_dir, tmp_path, cache, resume_from=checkpoint).deferred
    assert not plan(task_dir, tmp_path, cache).deferred


def test_rollout_only_generates_what_skip_run_generates(ray_session, task_dir, tmp_path, filled):
    train(task_dir, tmp_path, *cached(tmp_path / "fresh"), *NO_VALIDATION, "trainer.total_training_steps=1")
    ran, filled_by_rollout = (load_file(store(c) / "1" / "tensors.safetensors") for c in (tmp_path / "fresh", filled))
    for key in ("prompts", "responses", "response_mask"):
        assert torch.equal(ran[key], filled_by_rollout[key]), key


def test_an_entry_lost_mid_run_starts_the_engines_with_the_current_weights(ray_session, task_dir, tmp_path, filled):
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    t = trainer(task_dir, tmp_path, *cached(cache), *NO_VALIDATION)
    try:
        t.start()  # train-only: the plan found every step in the cache
        assert "train-only: every generation of steps 1-3" in t.console.export_text() and t.rollout.workers == []
        shutil.rmtree(store(cache) / "2")  # after the plan: the run meets the miss at step 2
        with pytest.warns(RuntimeWarning, match="starting the rollout engines: the generation of step 2"):
            t.fit()
    finally:
        t.close()
    assert len(t.rollout.workers) == 1 and t.rollout.calls == 1
    rows = [row for row in metrics(tmp_path / "run") if row["step"] > 0]
    # Steps 1 and 3 trained on skip rollout's samples (the starting weights), step 2 on the engine's,
    # generated with the weights of step 1, which it was given when it started.
    assert [row["training/staleness"] for row in rows] == [0.0, 0.0, 2.0]
