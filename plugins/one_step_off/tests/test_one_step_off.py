"""``trainer.schedule=one_step_off`` on the embedded default: the ordering verl specifies, read
back from the run's own metrics and profile."""

import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from skip_core import hookimpl
from skip_core.plugins import load_plugins
from skip_core.schedule import GEN, GLOBAL_STEPS, STEP, WEIGHT_SYNC
from skip_plugin_one_step_off.schedule import GENERATE_ASYNC
from training import metrics, overrides, train, undeclared_phases

pytestmark = pytest.mark.integration  # runs of the one_step_off schedule

ONE_STEP_OFF = (
    "trainer.schedule=one_step_off",
    "trainer.total_training_steps=4",
    "trainer.test_freq=-1",
    "trainer.resume_mode=disable",
)
CACHED = (*ONE_STEP_OFF, "skip.rollout.enable=true", "skip.rollout.steps=[1,2,3,4]")


def spans(profile, worker: str) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(profile.glob(f"*/worker_{worker}.jsonl"))
        for line in path.read_text().splitlines()
    ]


def end(span: dict) -> float:
    return span["start"] + span["duration_sec"]


class Overlap:
    """The driver's events in the order they happen, and a hold: step k's actor update begins only
    once the generation of batch k+1 has begun (its rollout call's skip lookup), as one step off
    promises. That schedule passes the hold at once, however slow the machine; a schedule that
    started batch k+1 only after training step k would wait ``timeout`` s and leave it noted."""

    def __init__(self, steps: list[int], timeout: float = 120) -> None:
        self.timeout, self.timed_out = timeout, False
        self.order: list[tuple[str, int]] = []  # appended from the driver's threads, one list.append each
        self.generating = {step: threading.Event() for step in steps}

    @hookimpl(tryfirst=True)
    def skip_precondition(self, role, step, call):
        # The run's rollout calls only: their prompts carry their step (train-only's look-ahead has none).
        if role.name == "rollout" and getattr(call.prompts, "meta_info", {}).get(GLOBAL_STEPS) == step:
            self.order.append(("generate", step))
            if step in self.generating:
                self.generating[step].set()

    @hookimpl
    def skip_span_sinks(self, worker):
        return self if worker == -1 else None

    def start(self, span) -> None:
        if span.name == "trainer/update_actor":
            step = span.attrs["step"]
            following = self.generating.get(step + 1)
            if following is not None and not self.timed_out and not following.wait(self.timeout):
                self.timed_out = True
                self.order.append(("hold timed out", step))
            self.order.append(("update_actor begins", step))
        elif span.name == f"trainer/{GEN}":
            self.order.append(("gen begins", span.attrs["step"]))

    def end(self, span) -> None:
        if span.name == "trainer/update_actor":
            self.order.append(("update_actor ends", span.attrs["step"]))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Profiled:
    directory: Path
    trainer: Any
    rows: list[dict]
    driver: list[dict]
    rollouts: dict[int, dict]  # the worker's rollout span of each step's batch
    phases: dict[tuple[str, int], dict]  # the driver's trainer/<phase> span of each step
    overlap: Overlap


@pytest.fixture(scope="module")
def profiled(ray_session, task_dir, tmp_path_factory) -> Profiled:
    """One profiled run, caching every batch, for the tests that read its metrics, its spans (one
    clock: ``time.time()``), the driver's order of events (``Overlap``) or its cache."""
    tmp_path = tmp_path_factory.mktemp("one_step_off")
    profile = tmp_path / "profile"
    overlap, plugins = Overlap(steps=[1, 2, 3, 4]), load_plugins()
    plugins.register(overlap)
    try:
        trainer, _ = train(task_dir, tmp_path, *CACHED, "profiling.enable=true", f"profiling.dir={profile}")
    finally:
        plugins.unregister(overlap)
    driver, rollout = spans(profile, "-1"), spans(profile, "0")
    rollouts = {s["step"]: s for s in rollout if s["event"] == "rollout" and s["phase"] == "train"}
    phases = {(s["event"].removeprefix("trainer/"), s["step"]): s for s in driver if s["event"].startswith("trainer/")}
    return Profiled(tmp_path, trainer, metrics(tmp_path / "run"), driver, rollouts, phases, overlap)


@pytest.mark.loaded
def test_batches_train_exactly_one_update_stale_with_one_weight_push_per_step(profiled):
    rows, rollouts = profiled.rows, profiled.rollouts
    # Batch 1 comes from the starting weights; every later one from the weights one update back.
    assert [row["training/staleness"] for row in rows] == [0, 1, 1, 1]
    for row in rows:
        assert {f"timing_s/{phase}" for phase in (GEN, GENERATE_ASYNC, WEIGHT_SYNC, STEP)} <= row.keys()
        assert "timing_s/old_log_prob" not in row  # bypass: the rollout log-probs are the old ones
    assert not undeclared_phases(profiled.trainer, rows)  # the trainer-schedule contract

    pushes = [s for s in profiled.driver if s["event"] == "weight_sync"]
    # One before the loop, then exactly one per step, timed as the contract's weight sync.
    timed_in = {s["span_id"]: s["event"] for s in profiled.driver}
    assert Counter(timed_in.get(push["parent_id"]) for push in pushes) == {None: 1, f"trainer/{WEIGHT_SYNC}": len(rows)}
    assert sorted(rollouts) == [row["step"] for row in rows]
    for push in pushes:  # never while a generation runs
        assert all(end(push) <= r["start"] or push["start"] >= end(r) for r in rollouts.values())


@pytest.mark.loaded
def test_generation_overlaps_training(profiled):
    """Batch k+1 generates while step k updates the actor, and the step's ``gen`` is only the
    wait for a batch whose generation was already under way: the order of the driver's events,
    which the schedule decides, with ``Overlap``'s hold making it independent of how fast each runs."""
    order = profiled.overlap.order
    steps = [row["step"] for row in profiled.rows]
    assert not profiled.overlap.timed_out, order
    for step in steps[:-1]:  # overlap: batch k+1 started before step k's update
        assert order.index(("generate", step + 1)) < order.index(("update_actor begins", step)), order
    for step in steps[1:]:  # the wait began after the update of the step before, the batch already generating
        assert order.index(("generate", step)) < order.index(("update_actor ends", step - 1)), order
        assert order.index(("update_actor ends", step - 1)) < order.index(("gen begins", step)), order
    assert [event for event, _ in order].count("generate") == len(steps)  # one generation per step


def test_a_cached_run_loads_every_batch_instead_of_generating(profiled, task_dir):
    again, output = train(task_dir, profiled.directory, *CACHED)
    assert profiled.trainer.rollout.calls == 4 and again.rollout.calls == 0
    replayed = metrics(profiled.directory / "run")
    assert [row["critic/score/mean"] for row in replayed] == [row["critic/score/mean"] for row in profiled.rows]
    # Every batch cached and nothing to validate: train-only, so no engine started, nor counted work.
    assert "train-only: every generation of steps 1-4" in output and again.rollout.workers == []
    assert not any(key.startswith("rollout/engine/") for row in replayed for key in row)


def test_each_step_logs_what_the_engine_did_meanwhile(profiled):
    rows = profiled.rows
    generated = sum(row["rollout/generated_tokens"] for row in rows)
    assert sum(row["rollout/engine/tokens"] for row in rows) >= generated > 0
    passes = sum(row["rollout/engine/decode_passes"] for row in rows)
    decoded = sum(row["rollout/engine/decode_rows"] for row in rows)
    assert passes <= sum(row["rollout/engine/forward_passes"] for row in rows)
    assert 1 <= decoded / passes <= 64  # mean running batch: at most one batch of 16 prompts x 4 samples
    for row in rows:
        if row["rollout/engine/decode_passes"]:
            assert row["rollout/engine/batch_rows_mean"] == pytest.approx(
                row["rollout/engine/decode_rows"] / row["rollout/engine/decode_passes"]
            )


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
        assert 0 <= row["rollout_corr/rollout_is_ratio_fraction_high"] <= 1
        assert row["rollout_corr/chi2_token"] >= -1e-6


def test_bypass_reinforce_weighs_and_rejects_in_the_policys_loss(ray_session, task_dir, tmp_path):
    """verl's rollout_correction example (REINFORCE in bypass mode) plus rejection: no old
    log-probs are recomputed; the policy's loss weighs and rejects by its own ratio to the
    rollout's log-probs, so the actor reports ``rollout_corr/*``."""
    train(
        task_dir,
        tmp_path,
        *ONE_STEP_OFF,
        "algorithm.rollout_correction.bypass_mode=true",  # null turns it off where rollout_is is set
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_rs=token_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5",
    )
    for row in metrics(tmp_path / "run"):
        assert "timing_s/old_log_prob" not in row and "actor/pg_clipfrac" not in row
        assert row["rollout_corr/rollout_is_batch_norm_factor"] > 0
        assert 0 <= row["rollout_corr/rollout_rs_masked_fraction"] <= 1
        assert row["rollout_corr/k3_kl"] >= 0 and "rollout_corr/rollout_is_eff_sample_size" in row


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("resources.actor.cpus=2", "resources.actor: the actor pool needs 1 x (2 CPU), which the Ray cluster (2 CPU"),
        # No node of the tests' Ray offers the resource: the pool can go nowhere.
        (
            "resources.rollout.ray_resources={node_b:1}",
            "resources.rollout: the rollout pool needs 1 x (1 CPU + 1 node_b)",
        ),
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
