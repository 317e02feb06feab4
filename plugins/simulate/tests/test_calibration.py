"""The simulator against runs it predicts: a real CPU run of the long_tail workload under each
schedule, recorded by ``benchmarks/bench_simulate.py --record`` (the sync run's profile spans
that the fit reads, its metrics with the engine's counters, and the three runs' measured mean
step times; data/long_tail/README.md says when and where)."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
from skip_plugin_simulate.calibration import predict_steps
from skip_plugin_simulate.measured import read_profile

DATA = Path(__file__).parent / "data" / "long_tail"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibration")
    (tmp / "profile.jsonl").write_bytes(gzip.decompress((DATA / "spans.jsonl.gz").read_bytes()))
    shutil.copy(DATA / "metrics.jsonl", tmp / "metrics.jsonl")
    measured = json.loads((DATA / "measured.json").read_text())["mean_step_s"]
    return read_profile(tmp / "profile.jsonl", tmp / "metrics.jsonl"), measured


def test_the_profile_fit_sees_the_run_as_it_was(recorded):
    fit, _ = recorded
    assert fit.steps == 16 and len(fit.groups) == 16 * 16  # 16 steps of 16 prompts
    assert {len(group) for group in fit.groups} == {4}  # 4 samples each, grouped by their prompt
    assert fit.validations == [0, 4, 8, 12, 16]
    assert fit.decode_s + fit.decode_s_per_row > 0 and fit.s_per_token > 0


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_predicted_step_time_ratios_are_within_15_percent_of_the_measured_ones(recorded, schedule):
    fit, measured = recorded
    predicted = predict_steps(fit, 16)
    real, model = measured[schedule] / measured["sync"], predicted[schedule] / predicted["sync"]
    assert model == pytest.approx(real, rel=0.15)
