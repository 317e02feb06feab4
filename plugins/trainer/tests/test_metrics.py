import io
import json
import math
import os
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from rich.console import Console
from skip_core.batch import Batch
from skip_core.schedule import TRAIN_PHASES
from skip_plugin_trainer.train.metrics import data_metrics, engine_metrics, throughput_metrics, timing_metrics
from skip_plugin_trainer.train.summary import plot, plot_figure, summary_table
from skip_plugin_trainer.train.tracking import MetricsWarning, Tracking

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_batch(num_turns: bool = True) -> Batch:
    """4 rows, prompt width P=3 (left-padded), response width T=4.

    response lengths 4, 2, 4, 1 (two clipped); prompt lengths 2, 3, 1, 3; row 2 is multi-turn: its
    response_mask has a hole (tool output) while its attention_mask covers the whole response.
    """
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    response_attention = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]])
    scores = torch.zeros(4, 4)
    scores[0, 3], scores[1, 1], scores[2, 3], scores[3, 0] = 1.0, 0.0, 0.5, -0.5
    rewards = scores.clone()
    rewards[:, 0] -= 0.1  # a per-token penalty: sequence rewards 0.9, -0.1, 0.4, -0.6
    advantages = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 99.0, 99.0], [0.5, 99.0, 99.0, 0.5], [-2.0, 99.0, 99.0, 99.0]]
    )
    non_tensors = {"num_turns": [1, 1, 3, 1]} if num_turns else {}
    return Batch.from_dict(
        {
            "responses": torch.randint(0, 100, (4, 4)),
            "attention_mask": torch.cat([prompt_mask, response_attention], dim=1),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": advantages,
        },
        non_tensors,
    )


def test_data_metrics_hand_computed():
    metrics = data_metrics(make_batch())
    expected = {
        "critic/score/mean": 0.25,
        "critic/score/max": 1.0,
        "critic/score/min": -0.5,
        "critic/rewards/mean": 0.15,
        "critic/rewards/max": 0.9,
        "critic/rewards/min": -0.6,
        "critic/advantages/mean": 1 / 9,  # 4*1 + 2*(-1) + 2*0.5 - 2 over 9 loss tokens; the 99s are masked
        "critic/advantages/max": 1.0,
        "critic/advantages/min": -2.0,
        "response_length/mean": 2.75,
        "response_length/max": 4.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 2.25,
        "prompt_length/max": 3.0,
        "prompt_length/min": 1.0,
        "num_turns/mean": 1.5,
        "num_turns/max": 3.0,
        "num_turns/min": 1.0,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert isinstance(metrics[key], float), key
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_data_metrics_without_num_turns_or_loss_tokens():
    batch = make_batch(num_turns=False)
    batch.batch["response_mask"] = torch.zeros(4, 4, dtype=torch.long)
    metrics = data_metrics(batch)
    assert not any(k.startswith("num_turns/") for k in metrics)
    assert math.isnan(metrics["critic/advantages/mean"]) and math.isnan(metrics["critic/advantages/max"])


def test_timing_and_throughput_metrics():
    batch = make_batch()  # 11 response tokens, 9 prompt tokens
    timing = {"gen": 2.0, "reward": 0.5, "adv": 0.1, "testing": 0.3, "step": 4.0}
    metrics = timing_metrics(timing, batch)
    assert metrics == pytest.approx(
        {
            "timing_s/gen": 2.0,
            "timing_s/reward": 0.5,
            "timing_s/adv": 0.1,
            "timing_s/testing": 0.3,
            "timing_s/step": 4.0,
            "timing_per_token_ms/gen": 2000 / 11,
            "timing_per_token_ms/reward": 500 / 20,
            "timing_per_token_ms/adv": 100 / 20,
        }
    )
    assert throughput_metrics(timing, batch, n_workers=2) == {
        "perf/total_num_tokens": 20.0,
        "perf/time_per_step": 4.0,
        "perf/throughput": 2.5,
    }


def read_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_engine_metrics_are_the_step_increase_of_each_counter():
    before = {"decode_passes": 10, "decode_rows": 40, "forward_s": 1.5}
    now = {"decode_passes": 14, "decode_rows": 52, "forward_s": 2.0}
    assert engine_metrics(before, now) == {
        "rollout/engine/decode_passes": 4,
        "rollout/engine/decode_rows": 12,
        "rollout/engine/forward_s": 0.5,
        "rollout/engine/batch_rows_mean": 3.0,
    }
    assert engine_metrics(now, now)["rollout/engine/decode_passes"] == 0
    assert "rollout/engine/batch_rows_mean" not in engine_metrics(now, now)  # the engine was idle
    assert engine_metrics({}, {}) == {}  # a backend that counts nothing


def test_jsonl_and_console_lines_are_written_at_each_step(tmp_path):
    out = io.StringIO()
    tracking = Tracking(["console", "jsonl"], tmp_path / "run", console=Console(file=out, width=200))
    tracking.log({"critic/score/mean": torch.tensor(0.5), "timing_s/gen": np.float32(1.5), "actor/pg_loss": -0.25}, 1)
    tracking.log({"critic/score/mean": 0.75}, step=2)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()  # before close
    assert json.loads(lines[0]) == {"step": 1, "critic/score/mean": 0.5, "timing_s/gen": 1.5, "actor/pg_loss": -0.25}
    assert json.loads(lines[1]) == {"step": 2, "critic/score/mean": 0.75}
    console_lines = out.getvalue().splitlines()
    assert console_lines == ["step 1 | score 0.5000 | pg_loss -0.25 | gen 1.50s", "step 2 | score 0.7500"]
    tracking.close()


def test_resume_drops_repeated_steps_and_a_truncated_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": k, "critic/score/mean": k / 10}) for k in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "critic/sc')
    tracking = Tracking(["jsonl"], tmp_path, resume_step=3)
    assert read_steps(path) == [1, 2, 3]
    assert [r["step"] for r in tracking.history] == [1, 2, 3]
    tracking.log({"critic/score/mean": 0.4}, step=4)
    assert read_steps(path) == [1, 2, 3, 4]
    assert tracking.history[-1] == {"step": 4, "critic/score/mean": 0.4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left behind


@pytest.mark.timeout(60)
def test_a_metrics_file_that_is_a_pipe_never_blocks_a_resume(tmp_path):
    """A metrics.jsonl that someone made a named pipe: its lines are left out, with a warning, and
    the run writes a regular file in its place."""
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    with pytest.warns(MetricsWarning, match="not a regular file"):
        tracking = Tracking(["jsonl"], tmp_path, resume_step=3)
    assert tracking.history == []
    tracking.log({"critic/score/mean": 0.4}, step=4)
    assert path.is_file() and read_steps(path) == [4]


def test_a_staged_line_survives_a_crash_and_the_final_line_replaces_it(tmp_path):
    """The step's line goes out before its checkpoint: killed in between, the resumed run keeps it."""
    out = io.StringIO()
    tracking = Tracking(["jsonl", "console"], tmp_path, console=Console(file=out, width=200))
    tracking.log({"critic/score/mean": 0.1}, 1)
    tracking.stage({"critic/score/mean": 0.2}, 2)
    assert [r["critic/score/mean"] for r in _read(tmp_path)] == [0.1, 0.2]
    assert "step 2" not in out.getvalue()  # staging writes the file only
    resumed = Tracking(["jsonl"], tmp_path, resume_step=2)  # the crash: step 2's checkpoint exists
    assert [r["step"] for r in resumed.history] == [1, 2]

    tracking.log({"critic/score/mean": 0.2, "timing_s/save_checkpoint": 0.5}, 2)
    assert [(r["step"], r.get("timing_s/save_checkpoint")) for r in _read(tmp_path)] == [(1, None), (2, 0.5)]
    assert "step 2" in out.getvalue()


def _read(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unknown_backend_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"'mlflow'.*allowed: console, jsonl, tensorboard, wandb"):
        Tracking(["jsonl", "mlflow"], tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("backend", "module"), [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_optional_backend_is_a_value_error_with_pip_hint(tmp_path, monkeypatch, backend, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail even where the package is installed
    with pytest.raises(ValueError, match=f"pip install {backend}"):
        Tracking(["console", backend], tmp_path / "run")


def test_tensorboard_and_wandb_receive_every_metric(tmp_path, monkeypatch):
    calls = []

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("tb_dir", log_dir))

        def add_scalar(self, key, value, step):
            calls.append(("tb", key, value, step))

        def close(self):
            calls.append(("tb_close",))

    class Run:
        def log(self, data, step):
            calls.append(("wandb", data, step))

        def finish(self):
            calls.append(("wandb_finish",))

    wandb = types.SimpleNamespace(init=lambda **kwargs: calls.append(("wandb_init", kwargs)) or Run())
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    tracking = Tracking(["tensorboard", "wandb"], tmp_path, {"lr": 1e-6}, project="p", experiment="e")
    tracking.log({"a": 1}, step=7)
    tracking.close()
    assert calls == [
        ("tb_dir", str(tmp_path / "tensorboard")),
        ("wandb_init", {"project": "p", "name": "e", "config": {"lr": 1e-6}, "dir": str(tmp_path)}),
        ("tb", "a", 1.0, 7),
        ("wandb", {"a": 1.0}, 7),
        ("tb_close",),
        ("wandb_finish",),
    ]


def test_failing_jsonl_backend_warns_once_and_logging_goes_on(tmp_path):
    out = io.StringIO()
    tracking = Tracking(["jsonl", "console"], tmp_path, console=Console(file=out))
    tracking.log({"critic/score/mean": 0.1}, step=1)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()  # the path can no longer be opened for appending
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracking.log({"critic/score/mean": 0.2}, step=2)
        tracking.log({"critic/score/mean": 0.3}, step=3)
    assert len(caught) == 1
    assert caught[0].category is MetricsWarning and "'jsonl'" in str(caught[0].message)
    assert len(out.getvalue().splitlines()) == 3
    assert [r["step"] for r in tracking.history] == [1, 2, 3]


def test_failing_console_warns_once(tmp_path):
    class BrokenFile(io.StringIO):
        def write(self, text):
            raise OSError("terminal gone")

    tracking = Tracking(["console", "jsonl"], tmp_path, console=Console(file=BrokenFile()))
    with pytest.warns(MetricsWarning, match=r"'console'.*terminal gone") as caught:
        for step in (1, 2):
            tracking.log({"x": step}, step=step)
    assert len(caught) == 1
    assert read_steps(tmp_path / "metrics.jsonl") == [1, 2]


HISTORY = [
    {"step": 1, "critic/score/mean": 0.1, "response_length/mean": 12.5, "timing_s/gen": 2.0, "timing_s/step": 4.0},
    {"step": 2, "actor/entropy": 0.7, "actor/pg_loss": -0.03, "actor/grad_norm": 1.25, "timing_s/step": 1.0},
    {
        "step": 3,
        "critic/score/mean": 0.5,
        "timing_s/gen": 2.5,
        "timing_s/reward": 0.5,
        "timing_s/update_actor": 0.5,
        "timing_s/step": 4.0,
    },
]


def test_summary_table_rows_and_totals():
    console = Console(record=True, width=160)
    console.print(summary_table(HISTORY, title="demo"))
    text = console.export_text()
    assert "demo" in text
    rows = [line.replace("│", " ").split() for line in text.splitlines() if line.startswith("│")]
    assert rows == [
        ["1", "0.1", "12.5", "-", "-", "-", "2.00", "4.00"],
        ["2", "-", "-", "0.7", "-0.03", "1.25", "-", "1.00"],
        ["3", "0.5", "-", "-", "-", "-", "2.50", "4.00"],
    ]
    assert "total 9.0s" in text and "mean step 3.00s" in text
    assert "gen 50% of step time" in text and "score 0.1 → 0.5" in text


def test_summary_table_of_empty_history():
    console = Console(record=True, width=160)
    console.print(summary_table([]))
    assert "total -s" in console.export_text()


@pytest.mark.parametrize("with_val", [False, True])
def test_plot_writes_a_png(tmp_path, with_val):
    history = [dict(r) for r in HISTORY]
    if with_val:
        history[2]["val/test_score/mean"] = 0.6
        history[2]["val-core/gsm8k/reward/mean@1"] = 0.55
    path = plot(history, tmp_path / "out" / "run.png")
    assert path == tmp_path / "out" / "run.png"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE)
    assert [p.name for p in path.parent.iterdir()] == ["run.png"]


def _score_lines(history):
    score_ax = plot_figure(history).axes[0]
    return {line.get_label(): (line.get_xdata().tolist(), line.get_ydata().tolist()) for line in score_ax.lines}


def test_plot_draws_the_only_data_source_once():
    history = [
        {"step": 0, "val/score/mean": 0.2, "val/arithmetic/score/mean": 0.2},
        {"step": 1, "critic/score/mean": 0.3, "timing_s/step": 1.0},
        {"step": 2, "critic/score/mean": 0.5, "val/score/mean": 0.4, "val/arithmetic/score/mean": 0.4},
    ]
    assert _score_lines(history) == {
        "train": ([1, 2], [0.3, 0.5]),
        "val/score/mean = val/arithmetic/score/mean": ([0, 2], [0.2, 0.4]),
    }


def test_plot_draws_each_data_source_of_several_and_folds_only_equal_ones():
    history = [
        {"step": 0, "val/score/mean": 0.3, "val/a/score/mean": 0.2, "val/b/score/mean": 0.4, "val/c/score/mean": 0.3},
        {"step": 2, "val/score/mean": 0.5, "val/a/score/mean": 0.4, "val/b/score/mean": 0.6, "val/c/score/mean": 0.5},
    ]
    assert _score_lines(history) == {
        "val/score/mean = val/c/score/mean": ([0, 2], [0.3, 0.5]),
        "val/a/score/mean": ([0, 2], [0.2, 0.4]),
        "val/b/score/mean": ([0, 2], [0.4, 0.6]),
    }


def test_plot_draws_train_and_val_once_when_they_coincide():
    history = [{"step": s, "critic/score/mean": 0.0, "val/score/mean": 0.0, "val/a/score/mean": 0.0} for s in (1, 2)]
    assert _score_lines(history) == {"train = val/score/mean = val/a/score/mean": ([1, 2], [0.0, 0.0])}


def _step(step, **seconds):
    """A logged step whose ``step`` time is its phases' sum plus 0.25 s outside them (``generate_async`` excluded)."""
    total = sum(v for k, v in seconds.items() if k != "generate_async") + 0.25
    return {"step": step, **{f"timing_s/{k}": v for k, v in {**seconds, "step": total}.items()}}


TRAIN = {"reward": 0.2, "old_log_prob": 0.5, "ref": 0.4, "adv": 0.01, "update_actor": 1.5}
# The order the trainer stacks a run's phases in (``stacked_phases``): its schedule's, then its own.
ORDER = ("gen", "sync_weights", "filter_groups", "sleep", *TRAIN_PHASES, "testing", "save_checkpoint")


@pytest.mark.parametrize(
    ("history", "given", "bars", "lines"),
    [
        (  # sync: validation and a checkpoint on step 2 only
            [
                _step(1, gen=3.0, **TRAIN, sync_weights=0.3),
                _step(2, gen=3.0, **TRAIN, sync_weights=0.3, testing=4.0, save_checkpoint=1.0),
            ],
            {"phases": ORDER},
            "gen sync_weights reward old_log_prob ref adv update_actor validation save_checkpoint other",
            {},
        ),
        (  # one_step_off: generate_async overlaps the step
            [
                _step(1, gen=3.0, generate_async=3.0, sync_weights=0.3, **TRAIN),
                _step(2, gen=0.5, generate_async=3.5, sync_weights=0.3, **TRAIN, testing=2.0),
            ],
            {"phases": ORDER, "background": ("generate_async",)},
            "gen sync_weights reward old_log_prob ref adv update_actor validation other",
            {"generate_async (background, not stacked)": [3.0, 3.5]},
        ),
        (  # no order given (the contract's), and phases it does not know: a bar each after it, not "other"
            [_step(1, gen=0.2, **TRAIN, sync_weights=0.4, testing=2.0, prefetch=0.7)],
            {},
            "gen reward old_log_prob ref adv update_actor sync_weights prefetch validation other",
            {},
        ),
    ],
    ids=["sync", "one_step_off", "default"],
)
def test_plot_stacks_every_timed_phase_up_to_the_step_time(history, given, bars, lines):
    time_ax = plot_figure(history, **given).axes[1]
    assert [c.get_label() for c in time_ax.containers] == bars.split()
    tops = [max(p.get_y() + p.get_height() for p in patches) for patches in zip(*time_ax.containers, strict=True)]
    assert tops == pytest.approx([r["timing_s/step"] for r in history])
    assert [p.get_height() for p in time_ax.containers[-1]] == pytest.approx([0.25] * len(history))
    assert {line.get_label(): line.get_ydata().tolist() for line in time_ax.lines} == lines


def test_a_phase_keeps_its_colour_whichever_phases_a_run_timed():
    def colours(history):
        time_ax = plot_figure(history, ORDER).axes[1]
        return {c.get_label(): c.patches[0].get_facecolor() for c in time_ax.containers}

    some = colours([_step(1, gen=1.0, update_actor=1.0)])
    every = colours([_step(1, gen=1.0, sleep=0.1, **TRAIN, sync_weights=0.3, testing=1.0)])
    assert some["gen"] == every["gen"] and some["update_actor"] == every["update_actor"]
    assert len({every[phase] for phase in every if phase != "other"}) == len(every) - 1  # each its own


@pytest.mark.parametrize("steps", [1, 40])
def test_plot_legends_lie_outside_the_axes_and_inside_the_figure(steps):
    history = [
        {**_step(s, gen=3.0, **TRAIN, sync_weights=0.3, testing=2.0), "critic/score/mean": 0.1 * s}
        | {"val/score/mean": 0.1, "val/a/score/mean": 0.0, "val/b/score/mean": 0.2}
        for s in range(1, steps + 1)
    ]
    fig = plot_figure(history)
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent())
        assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1
        assert fig.bbox.y0 <= legend.y0 and legend.y1 <= fig.bbox.y1
