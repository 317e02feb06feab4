"""``skip simulate`` as a user runs it: presets, overrides, sweeps, a profile, and bad input."""

import gzip
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from skip_core.cli import cli

SMALL = ["trainer.total_training_steps=3", "cluster.devices=4", "cluster.rollout_devices=2"]
DATA = Path(__file__).parent / "data" / "long_tail"


def simulate(*args):
    return CliRunner().invoke(cli, ["simulate", *args], catch_exceptions=False)


def test_a_preset_with_overrides_prints_every_schedule_the_recommendation_and_writes_the_plot(tmp_path):
    plot = tmp_path / "out" / "throughput.png"
    result = simulate("default", *SMALL, "--plot", str(plot))
    assert result.exit_code == 0, result.output
    for schedule in ("sync", "one_step_off", "fully_async"):
        assert schedule in result.output
    assert "fastest: " in result.output and plot.read_bytes().startswith(b"\x89PNG")
    assert re.search(r"one_step_off rollout_devices=2: 0: \d+%, 1: \d+%", result.output)  # staleness spread


def test_by_default_the_overlapped_schedules_also_try_other_rollout_trainer_splits(tmp_path):
    result = simulate("default", *SMALL, "--plot", str(tmp_path / "p.png"))
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│") and "rollout_devices=" in line]
    for split in (1, 2, 3):  # a quarter, half and three quarters of 4 devices
        assert sum(f"rollout_devices={split} " in row for row in rows) == (3 if split == 1 else 2)
    assert sum(" sync " in row for row in rows) == 1  # colocated sync uses every device whatever the split
    assert all(row.count("x ") >= 1 for row in rows)  # every split compared to that sync


def test_split_none_keeps_the_scenarios_own_split(tmp_path):
    result = simulate("default", *SMALL, "--split", "none", "--plot", str(tmp_path / "p.png"))
    assert result.exit_code == 0, result.output
    assert "rollout_devices=" not in result.output


def test_a_sweep_runs_each_point_and_names_the_fastest_with_its_settings(tmp_path):
    result = simulate(
        *SMALL,
        *(
            "-s",
            "fully_async",
            "--sweep",
            "cluster.rollout_devices=1,3",
            "--sweep",
            "async_training.staleness_threshold=0.5",
        ),
        *("--plot", str(tmp_path / "p.png")),
    )
    assert result.exit_code == 0, result.output
    assert "rollout_devices=1" in result.output and "rollout_devices=3" in result.output
    assert "fully_async rollout_devices=1 staleness_threshold=0.5: 0: " in result.output  # keys' last parts
    assert "fastest: fully_async with cluster.rollout_devices=" in result.output


def test_a_preset_with_a_published_figure_prints_it_beside_the_prediction(tmp_path):
    result = simulate("verl_fully_async_32", "trainer.total_training_steps=2", "--plot", str(tmp_path / "p.png"))
    assert result.exit_code == 0, result.output
    assert re.search(r"fully_async: published 2\.66x, predicted \d+\.\d\dx", result.output), result.output


def test_from_a_profile_it_says_what_it_measured(tmp_path):
    (tmp_path / "profile.jsonl").write_bytes(gzip.decompress((DATA / "spans.jsonl.gz").read_bytes()))
    shutil.copy(DATA / "metrics.jsonl", tmp_path / "metrics.jsonl")  # beside the profile: the engine's counters
    profile = tmp_path / "profile"
    profile.mkdir()
    shutil.move(tmp_path / "profile.jsonl", profile / "worker_0.jsonl")
    result = simulate("--from-profile", str(profile), *SMALL, "--plot", str(tmp_path / "p.png"))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "256 prompts, 1024 samples, 16 steps" in said and "engine's counters over 16 steps" in said


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_preset"], "presets: default"),
        (["engines.max_batch=0"], "engines.max_batch"),
        (["async_training.staleness_threshold=-1"], "staleness_threshold"),
        (["-s", "no_such_schedule"], "unknown schedule 'no_such_schedule'"),
        (["--sweep", "cluster.rollout_devices"], "expected key=value1,value2"),
        (["--split", "0.5,2"], "--split: '2' is not a share between 0 and 1"),
    ],
)
def test_bad_input_is_an_error_naming_what_is_wrong(args, message):
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == 2 and message in result.output, result.output
