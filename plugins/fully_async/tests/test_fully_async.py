"""``trainer.schedule=fully_async`` on the embedded default: streaming, the staleness bound,
partial rollout, failures, the equivalence with ``sync`` and the ``async_rollout`` cache."""

import math

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.entries import scan, verify
from skip_core.schedule import WEIGHT_SYNC
from skiptests import CONFIGS
from training import metrics, overrides, train, undeclared_phases

pytestmark = pytest.mark.integration  # runs of the fully_async schedule

FULLY_ASYNC = ("trainer.schedule=fully_async", "trainer.test_freq=-1", "trainer.resume_mode=disable")
# What makes the two schedules train on the same thing: no staleness, a sync after every update,
# recomputed old log-probs as sync does them.
EQUIVALENT = (
    "async_training.staleness_threshold=0",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.partial_rollout=false",
    "algorithm.rollout_correction.bypass_mode=false",
)
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "response_length/mean")


def test_staleness_zero_and_a_sync_per_update_reproduce_the_sync_schedule(ray_session, task_dir, tmp_path):
    # The tiny test model scores 0, so advantages are 0: the entropy bonus and the KL loss make
    # every update move the weights, and later rollouts depend on when they reached the engines.
    common = (
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "actor.entropy_coeff=0.01",
        "actor.use_kl_loss=true",
    )
    train(task_dir, tmp_path / "sync", *common)
    train(task_dir, tmp_path / "async", *common, "trainer.schedule=fully_async", *EQUIVALENT)
    synced, streamed = metrics(tmp_path / "sync" / "run"), metrics(tmp_path / "async" / "run")
    assert len(synced) == len(streamed) == 3
    for a, b in zip(synced, streamed, strict=True):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert b["training/staleness_max"] == 0
    assert all(row["actor/grad_norm"] > 0 for row in synced)


# Six steps syncing every second update, streaming ahead by half a window; every sample cached.
BOUNDED = (
    *FULLY_ASYNC,
    "trainer.total_training_steps=6",
    "async_training.trigger_parameter_sync_step=2",
    "async_training.staleness_threshold=0.5",
    "skip.async_rollout.enable=true",
    f"skip.async_rollout.steps=[{','.join(map(str, range(1, 25)))}]",
)


@pytest.fixture(scope="module")
def bounded(ray_session, task_dir, tmp_path_factory):
    """The ``BOUNDED`` run: its trainer, metrics and cache, for the tests that read or replay it."""
    tmp_path = tmp_path_factory.mktemp("bounded")
    trainer, _ = train(task_dir, tmp_path, *BOUNDED)
    return trainer, metrics(tmp_path / "run"), tmp_path / "cache"


@pytest.mark.loaded
def test_trajectories_stay_within_the_staleness_bound(bounded):
    trainer, rows, _ = bounded
    trigger, threshold = 2, 0.5
    # A sample waits behind at most (1 + threshold) x trigger updates' worth, generated with
    # weights at most trigger - 1 updates older than those current when it was fed.
    bound = math.ceil((1 + threshold) * trigger) + trigger - 1
    assert max(row["training/staleness_max"] for row in rows) <= bound
    # Step 2 trains on weights updated once, with samples the engines generated before any sync.
    assert max(row["training/staleness_max"] for row in rows) >= 1  # it did stream ahead
    assert [row["fully_async/count/current_param_version"] for row in rows] == [0, 2, 2, 4, 4, 6]
    assert [f"timing_s/{WEIGHT_SYNC}" in row for row in rows] == [False, True] * 3  # a sync every second update
    assert not undeclared_phases(trainer, rows)  # the trainer-schedule contract


@pytest.mark.loaded
def test_partial_rollout_continues_interrupted_samples_with_the_new_weights(
    ray_session, held_backend, task_dir, tmp_path
):
    # The engine holds its first request until a sync pauses it (``HeldUntilPaused``): that
    # sample is certainly generating when step 1's sync lands, whatever else runs faster.
    train(
        task_dir,
        tmp_path,
        *FULLY_ASYNC,
        f"rollout.backend={held_backend}",
        "trainer.total_training_steps=4",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1",
    )
    rows = metrics(tmp_path / "run")
    assert sum(row["fully_async/partial/total_partial_num"] for row in rows) >= 1  # the held one, at least
    assert max(row["fully_async/partial/max_partial_span"] for row in rows) >= 1  # it went on with new weights


@pytest.mark.loaded
def test_validation_with_partial_rollout_pauses_the_samples_in_flight_instead_of_waiting(
    ray_session, held_backend, task_dir, tmp_path
):
    # No scheduled sync in 3 steps (trigger 4), a validation after each: only validation brings
    # the engines up to date, and the samples it finds generating continue with the new weights.
    # The engine holds its first request until then: waiting for it instead would never end.
    train(
        task_dir,
        tmp_path,
        "trainer.schedule=fully_async",
        f"rollout.backend={held_backend}",
        "trainer.resume_mode=disable",
        "trainer.total_training_steps=3",
        "trainer.test_freq=1",
        "async_training.trigger_parameter_sync_step=4",
        "async_training.staleness_threshold=1",
    )
    rows = [row for row in metrics(tmp_path / "run") if row["step"] > 0]
    assert all("val/score/mean" in row and f"timing_s/{WEIGHT_SYNC}" not in row for row in rows)
    assert sum(row["fully_async/partial/total_partial_num"] for row in rows) >= 1
    assert max(row["training/staleness_max"] for row in rows) >= 1  # the held sample trains after step 1


def test_a_failing_rollout_fails_the_run_with_its_error(task_dir, tmp_path):
    args = overrides(task_dir, tmp_path, *FULLY_ASYNC, "trainer.total_training_steps=2", "rollout.timeout_s=0.0001")
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *args])
    assert result.exit_code != 0
    assert "did not answer within timeout_s" in repr(result.exception) + result.output
    assert not (tmp_path / "run" / "plot.png").exists()  # no report of a run that did not finish


def test_the_async_rollout_role_caches_every_sample_and_a_second_run_loads_them(bounded, task_dir, tmp_path):
    first, _, cache = bounded
    assert sorted(int(p.name) for p in scan(cache)) == list(range(1, 25))  # 6 steps x 4 samples
    assert {verify(p)["role"] for p in scan(cache)} == {"async_rollout"}
    again, _ = train(task_dir, tmp_path, *BOUNDED, f"skip.async_rollout.dump_dir={cache}")
    assert first.rollout.calls == 24 and again.rollout.calls == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("async_training.stalenes_threshold=1", "async_training.stalenes_threshold: unknown key"),
        ("async_training.require_batches=0", "async_training.require_batches: expected an integer > 0"),
        ("async_training.trigger_parameter_sync_step=-1", "async_training.trigger_parameter_sync_step"),
    ],
)
def test_bad_async_training_fails_before_the_first_step_naming_the_key(task_dir, tmp_path, override, message):
    args = overrides(task_dir, tmp_path, *FULLY_ASYNC, override)
    result = CliRunner().invoke(cli, ["run", "--config-dir", str(CONFIGS), *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
