"""The installed schedule plugins, unchanged, against the simulated trainer: the invariants a
schedule must keep at any scale, read from what the simulated run trained."""

import contextlib
from collections import Counter

import pytest
from skip_core import spans
from skip_core.config import ConfigError
from skip_core.plugins import registry
from skip_core.schedule import WEIGHT_SYNC
from skip_plugin_simulate.clock import Clock
from skip_plugin_simulate.config import Simulation
from skip_plugin_simulate.run import SimulatedRun
from skip_plugin_simulate.simulate import load, simulate, summarize

SCHEDULES = ["sync", "one_step_off", "fully_async"]


def config(**overrides):
    base = {
        "requests": {"prompt_tokens": 64, "response_median": 200, "prompt_sigma": 0.8, "sample_sigma": 0.3},
        "engines": {"decode_s": 0.01, "decode_s_per_row": 0.0002, "max_batch": 64},
        "training": {"s_per_token": 0.0002, "fixed_s": 0.5},
        "cluster": {"devices": 8, "rollout_devices": 4},
        "data": {"train_batch_size": 16, "prompts": 200},
        "rollout": {"n": 4},
        "actor": {"ppo_mini_batch_size": 4},
        "trainer": {"total_training_steps": 12, "save_freq": 3},
    }
    for key, value in overrides.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return load(base)


def samples(timeline):
    return [sample for step in sorted(timeline.trained) for sample in timeline.trained[step]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_sample_fed_trains_once_and_every_step_trains_a_full_batch(schedule):
    sim, sections = config()
    timeline = simulate(sim, schedule, sections)
    trained = samples(timeline)
    assert [row["step"] for row in timeline.rows] == list(range(1, 13))
    assert all(len(timeline.trained[step]) == 16 * 4 for step in timeline.trained)
    assert max(Counter(trained).values()) == 1
    prompts = sorted({(epoch, prompt) for epoch, prompt, _ in trained})
    assert prompts == [(prompt // 200, prompt % 200) for prompt in range(12 * 16)]  # the loader's order, none skipped


class Watched(SimulatedRun):
    """The simulated trainer, keeping each step's record; a weight push and a step are spans, so the
    span a push runs in says which phase timed it."""

    PUSH, STEP = "test/weight_push", "test/step"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records = []

    @contextlib.contextmanager
    def step(self, step):
        with spans.span(self.STEP), super().step(step) as record:
            self.records.append(record)
            yield record

    def sync_weights(self, interrupt: bool = False) -> None:
        with spans.span(self.PUSH):
            super().sync_weights(interrupt)


class PushParents:
    """A span sink noting the span each weight push ran in."""

    def __init__(self) -> None:
        self.parents: list[str | None] = []

    def end(self, span) -> None:
        if span.name == Watched.PUSH:
            self.parents.append(span.parent.name if span.parent else None)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("schedule", sorted(registry().schedules))
def test_a_schedule_times_only_its_declared_phases_in_order_and_its_weight_push_as_the_weight_sync(schedule):
    """The trainer-schedule contract, for every installed schedule: what it times is its
    ``phases`` (in their order) and ``background``, and a push inside a step is ``WEIGHT_SYNC``."""
    sim, sections = config(trainer__total_training_steps=4, async_training__trigger_parameter_sync_step=2)
    plan = registry().schedules[schedule](sections)
    run, sink = Watched(sim, plan.overlapped, Clock()), PushParents()
    spans.attach(sink)
    try:
        run.clock.run(lambda: plan.fit(run))
    finally:
        spans.close()
    assert [record.step for record in run.records] == [1, 2, 3, 4]
    for record in run.records:
        assert record.timing and set(record.timing) <= {*plan.phases, *plan.background}
        own = [phase for phase in record.timing if phase in plan.phases]  # in the order each first ended
        assert own == [phase for phase in plan.phases if phase in own]
    # Pushes before the first step are the schedule's to make untimed; inside a step, none is.
    assert f"trainer/{WEIGHT_SYNC}" in sink.parents
    assert set(sink.parents) <= {None, f"trainer/{WEIGHT_SYNC}"}


def test_staleness_is_what_each_schedule_promises():
    sim, sections = config(async_training__staleness_threshold=0.5, async_training__trigger_parameter_sync_step=2)
    rows = {name: simulate(sim, name, sections).rows for name in SCHEDULES}
    assert {row["training/staleness_max"] for row in rows["sync"]} == {0}
    assert [row["training/staleness_max"] for row in rows["one_step_off"]] == [0] + [1] * 11
    shares = summarize("one_step_off", simulate(sim, "one_step_off", sections)).staleness
    assert shares == pytest.approx({0: 1 / 12, 1: 11 / 12})  # the distribution, per trained sample
    # fully_async bounds what it feeds per weight version (verl's admission control): the prompts
    # carried into a window and those fed during it stay within required x (1 + threshold) x trigger.
    timeline = simulate(sim, "fully_async", sections)
    assert timeline.windows and all(carried + fed <= int(16 * 1.5 * 2) for carried, fed in timeline.windows)
    assert max(fed for _, fed in timeline.windows) > 16 * 2  # and it does feed ahead of the trainer


def test_the_schedules_run_in_virtual_time_with_the_modelled_costs():
    sim, sections = config()
    sync = summarize("sync", simulate(sim, "sync", sections))
    one = summarize("one_step_off", simulate(sim, "one_step_off", sections))
    assert sync.wall_s > 12 * sim.training.fixed_s  # every step trains, at least its fixed cost
    assert sync.trainer_idle > 0 and one.trainer_idle < sync.trainer_idle  # overlap hides generation


def test_resume_from_a_checkpoint_trains_what_the_uninterrupted_run_did_not_yet():
    sim, sections = config()
    whole = simulate(sim, "fully_async", sections)
    crashed = simulate(sim, "fully_async", sections, crash_at=8)
    assert crashed.crashed and max(crashed.trained) == 7
    checkpoint = crashed.checkpoints[6]
    resumed = simulate(sim, "fully_async", sections, resume=checkpoint)
    assert [row["step"] for row in resumed.rows] == list(range(7, 13))
    before = [s for step in range(1, 7) for s in crashed.trained[step]]
    after = samples(resumed)
    assert max(Counter(before + after).values()) == 1  # nothing trains twice across the crash
    assert sorted(before + after) == sorted(samples(whole))  # and nothing is lost


def test_a_bad_key_names_itself():
    with pytest.raises(ConfigError, match=r"engines\.decode_s"):
        load({"engines": {"decode_s": -1}})
    with pytest.raises(ConfigError, match="staleness_threshold"):
        load({"async_training": {"staleness_threshold": "many"}})


def test_the_simulation_model_has_every_default():
    assert Simulation().cluster.devices >= Simulation().cluster.rollout_devices


SCALE = {
    "cluster__devices": 256,
    "cluster__rollout_devices": 128,
    "data__train_batch_size": 640,
    "rollout__n": 16,
    "actor__ppo_mini_batch_size": 160,
    "trainer__total_training_steps": 4,
    "trainer__save_freq": 2,
    "async_training__staleness_threshold": 0.5,
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_at_cluster_scale_no_sample_is_lost_or_trained_twice_and_no_sync_deadlocks(schedule):
    sim, sections = config(**SCALE)
    timeline = simulate(sim, schedule, sections)  # a deadlock at any sync raises Deadlock
    assert timeline.peak_in_flight >= 10_000  # 640 prompts x 16 samples, on 128 engines
    trained = samples(timeline)
    assert len(trained) == 4 * 640 * 16 and max(Counter(trained).values()) == 1
    assert sorted({(e, p) for e, p, _ in trained}) == [(p // 200, p % 200) for p in range(4 * 640)]
    if schedule == "fully_async":  # 640 prompts x 1.5 x 4 updates per sync window
        assert all(carried + fed <= 640 * 1.5 * 4 for carried, fed in timeline.windows)


def test_at_cluster_scale_a_resumed_run_trains_what_the_uninterrupted_one_did():
    sim, sections = config(**SCALE)
    whole = simulate(sim, "fully_async", sections)
    crashed = simulate(sim, "fully_async", sections, crash_at=4)
    resumed = simulate(sim, "fully_async", sections, resume=crashed.checkpoints[2])
    before = [s for step in (1, 2) for s in crashed.trained[step]]
    assert sorted(before + samples(resumed)) == sorted(samples(whole))
