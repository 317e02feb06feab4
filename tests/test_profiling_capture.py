"""Capture: spans from a real rollout and a real training run reach the logs, nested and complete,
from several processes, threads and asyncio tasks; a SIGKILL loses a bounded window, an
exception nothing."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner
from skip_core import encoding, spans
from skip_core.cli import cli
from skip_core.config import ConfigError
from skip_core.entries import scan
from skip_core.plugins import registry
from skip_core.schedule import GEN, STEP, WEIGHT_SYNC
from skip_core.sections import parse_sections
from skip_plugin_profiling.recorder import ProfilingWarning, Recorder
from skip_plugin_trainer.commands import compose_config
from skiptests import CONFIGS, SMALL


@pytest.fixture(autouse=True)
def _no_sinks_left():
    yield
    spans.close()


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(rows: list[dict]) -> dict[int, dict]:
    return {row["span_id"]: row for row in rows}


def test_rollout_of_the_embedded_default_is_captured_whole(tiny_model_dir, tmp_path):
    """Every request of a `skip rollout` (hf backend, calculator tool) has its turns, engine calls
    and tool calls, nested in time and by parent, and their counts match the returned batch."""
    args = [
        "rollout", "--config-dir", str(CONFIGS), *SMALL, f"task.dir={tiny_model_dir.parent}",
        "profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}", f"output_dir={tmp_path / 'out'}",
    ]  # fmt: skip
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = lines(tmp_path / "profile" / "step_1" / "worker_0.jsonl")
    (entry,) = scan(tmp_path / "out")
    batch = encoding.read(entry)

    spans_of = Counter(row["event"] for row in rows)
    assert spans_of["rollout"] == 1 and spans_of["padding"] == 1
    assert spans_of["request"] == spans_of["preprocess"] == len(batch) == 8
    assert spans_of["generate"] == spans_of["turn"] == batch.non_tensor_batch["num_turns"].sum()
    assert spans_of["tool_call"] == batch.non_tensor_batch["tool_calls"].sum()
    assert spans_of["tool_create"] == spans_of["tool_reward"] == spans_of["tool_release"] == 8

    index = by_id(rows)
    requests = {row["extra"]["request_id"]: row for row in rows if row["event"] == "request"}
    expected_parent = {"generate": "turn", "tool_call": "turn", "turn": "request", "tool_reward": "request",
                       "request": "rollout", "preprocess": "rollout", "padding": "rollout"}  # fmt: skip
    for row in rows:
        assert row["step"] == 1 and row["workid"] == 0 and row["phase"] == "train"
        assert {"timestamp", "event", "duration_sec"} <= row.keys()
        if row["event"] in expected_parent:
            parent = index[row["parent_id"]]
            assert parent["event"] == expected_parent[row["event"]]
            assert parent["start"] <= row["start"] and row["start"] + row["duration_sec"] <= _end(parent) + 1e-6
        if row["event"] not in ("rollout", "padding"):
            assert row["extra"]["request_id"] in requests  # the request context reaches every child

    turns = defaultdict(list)
    for row in rows:
        if row["event"] == "generate":
            turns[row["extra"]["request_id"]].append(row["extra"]["turn"])
    for request_id, request in requests.items():
        assert sorted(turns[request_id]) == list(range(1, request["extra"]["turns"] + 1))
    assert sorted(r["extra"]["response_tokens"] for r in requests.values()) == sorted(
        batch.batch["response_mask"].sum(dim=1).tolist()
    )


def _end(row: dict) -> float:
    return row["start"] + row["duration_sec"]


def test_a_training_run_profiles_the_driver_and_every_rollout_worker(ray_session, tiny_model_dir, tmp_path):
    from rich.console import Console
    from skip_plugin_trainer.train.trainer import run

    overrides = [
        *SMALL, f"task.dir={tiny_model_dir.parent}", "trainer.total_training_steps=1", "trainer.val_before_train=false",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "resources.num_cpus=2",
        "resources.torch_threads=1", "resources.rollout.workers=2", "resources.rollout.cpus_per_worker=0.5",
        f"trainer.default_local_dir={tmp_path / 'run'}", "skip.rollout.enable=true",
        f"skip.rollout.dump_dir={tmp_path / 'cache'}", "profiling.enable=true",
    ]  # fmt: skip
    run(compose_config(CONFIGS, "run", tuple(overrides)), Console(record=True, width=200))
    step = tmp_path / "run" / "profile" / "step_1"
    assert sorted(p.name for p in step.iterdir()) == ["worker_-1.jsonl", "worker_0.jsonl", "worker_1.jsonl"]

    driver = lines(step / "worker_-1.jsonl")
    events = Counter(row["event"] for row in driver)
    for phase in (STEP, GEN, "reward", "old_log_prob", "adv", "update_actor", WEIGHT_SYNC, "testing"):
        assert events[f"trainer/{phase}"] == 1, phase
    assert sorted(row["workid"] for row in driver if row["event"] == "barrier_wait") == [0, 1]
    assert min(row["duration_sec"] for row in driver if row["event"] == "barrier_wait") == 0.0  # the slowest
    lookup = [row for row in driver if row["event"] == "skip_lookup"]
    assert [row["extra"]["cache"] for row in lookup] == ["miss"] and events["skip_dump"] == 1
    assert events["batch_construction"] == 1 and events["weight_sync"] == 1

    for rank in (0, 1):
        worker = lines(step / f"worker_{rank}.jsonl")
        assert {row["workid"] for row in worker} == {rank}
        assert Counter(row["event"] for row in worker)["request"] == 4  # half of 4 prompts x 2 samples
        assert any(row["event"] == "weight_sync" for row in worker)
    assert (tmp_path / "run" / "profile" / "val_step_1").is_dir()  # the final validation, apart


@pytest.mark.loaded
def test_threads_and_tasks_write_every_span_with_their_own_context(tmp_path):
    recorder = Recorder(tmp_path, worker=3, flush_interval_s=0.01)
    spans.attach(recorder)

    def thread_work(name: str) -> None:
        for i in range(500):
            with spans.span("request", step=1, request_id=f"{name}-{i}"), spans.span("generate"):
                pass

    async def task_work(name: str) -> None:
        with spans.span("request", step=2, request_id=name):
            for turn in range(1, 4):
                with spans.span("turn", turn=turn), spans.span("generate"):
                    await asyncio.sleep(0)

    async def tasks() -> None:
        await asyncio.gather(*(task_work(f"task-{i}") for i in range(200)))

    threads = [threading.Thread(target=thread_work, args=(f"thread-{t}",)) for t in range(4)]
    for thread in threads:
        thread.start()
    asyncio.run(tasks())
    for thread in threads:
        thread.join()
    spans.close()

    step1, step2 = lines(tmp_path / "step_1" / "worker_3.jsonl"), lines(tmp_path / "step_2" / "worker_3.jsonl")
    assert len(step1) == 4 * 500 * 2 and len(step2) == 200 * 7
    for rows in (step1, step2):
        index = by_id(rows)
        assert len(index) == len(rows)  # span ids unique across threads
        for row in rows:
            if row["event"] != "request":
                parent = index[row["parent_id"]]
                assert parent["extra"]["request_id"] == row["extra"]["request_id"]
    generate_turns = Counter((r["extra"]["request_id"], r["extra"]["turn"]) for r in step2 if r["event"] == "generate")
    assert len(generate_turns) == 600 and set(generate_turns.values()) == {1}


CHILD = textwrap.dedent(
    """
    import sys, time
    from skip_core import spans
    from skip_plugin_profiling.recorder import Recorder

    recorder = Recorder(sys.argv[1], worker=0, flush_interval_s=float(sys.argv[2]))
    spans.attach(recorder)
    for i in range(int(sys.argv[3])):
        with spans.span("generate", step=1, index=i):
            time.sleep(0.0005)
        if i == 200:
            print("running", flush=True)
    raise RuntimeError("the run fails after its last span")
    """
)


def child(tmp_path: Path, interval: float, count: int) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, str(script), str(tmp_path / "profile"), str(interval), str(count)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.loaded
def test_an_exception_loses_no_span(tmp_path):
    process = child(tmp_path, interval=5.0, count=2000)  # no periodic flush before the end
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0 and "the run fails" in stderr
    rows = lines(tmp_path / "profile" / "step_1" / "worker_0.jsonl")
    assert sorted(row["extra"]["index"] for row in rows) == list(range(2000))


# Records the number of spans each line of stdin asks for, then prints how many it has recorded
# in all and waits for the next line: between two lines nothing but the flush thread runs.
STEPPED_CHILD = textwrap.dedent(
    """
    import sys
    from skip_core import spans
    from skip_plugin_profiling.recorder import Recorder

    spans.attach(Recorder(sys.argv[1], worker=0, flush_interval_s=float(sys.argv[2])))
    recorded = 0
    for line in sys.stdin:
        for _ in range(int(line)):
            with spans.span("generate", step=1, index=recorded):
                pass
            recorded += 1
        print(recorded, flush=True)
    """
)


def written(path: Path) -> list[int]:
    """The span indices of the whole lines in ``path``: a write in progress (or cut by SIGKILL)
    may leave the last line short, never any other."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["extra"]["index"] for line in text.splitlines(keepends=True) if line.endswith("\n")]


@pytest.mark.loaded
def test_sigkill_loses_only_the_spans_since_the_last_flush(tmp_path):
    """The flush thread writes on its own while the process records nothing (no exit, no close);
    a SIGKILL then loses none of what it wrote: only spans ended since its last flush can be
    missing, and whole lines, in order, at the end."""
    script = tmp_path / "child.py"
    script.write_text(STEPPED_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    log = tmp_path / "profile" / "step_1" / "worker_0.jsonl"
    args = [sys.executable, str(script), str(tmp_path / "profile"), "0.05"]
    process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for total in (300, 600):
            process.stdin.write("300\n")
            process.stdin.flush()
            assert int(process.stdout.readline()) == total
            deadline = time.monotonic() + 120  # a flush thread that never runs, not a slow one
            while len(written(log)) < total and time.monotonic() < deadline:
                time.sleep(0.01)
            assert written(log) == list(range(total))  # flushed while the process waits
        process.stdin.write("5000\n")
        process.stdin.flush()
        assert int(process.stdout.readline()) == 5600
    finally:
        process.kill()  # SIGKILL: no atexit, no close, no final drain
        process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    indices = written(log)
    assert indices == list(range(len(indices))) and 600 <= len(indices) <= 5600


def test_a_failing_write_warns_and_the_work_goes_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    recorder = Recorder(blocker, worker=0, flush_interval_s=60)
    spans.attach(recorder)
    with spans.span("generate", step=1):
        pass
    with pytest.warns(ProfilingWarning, match="training goes on"):
        recorder.flush()
    with spans.span("generate", step=1):
        pass
    recorder.close()
    assert recorder.dropped == 2 and recorder.written == 0


def test_only_the_configured_steps_are_recorded(tmp_path):
    recorder = Recorder(tmp_path, worker=0, steps=[2], flush_interval_s=60)
    spans.attach(recorder)
    for step in (1, 2, 3):
        with spans.span("trainer/step", step=step), spans.span("generate"):
            pass
    spans.close()
    assert [p.name for p in tmp_path.iterdir()] == ["step_2"]
    assert len(lines(tmp_path / "step_2" / "worker_0.jsonl")) == 2


def test_without_a_sink_spans_cost_nothing_and_record_nothing(tmp_path):
    spans.close()
    with spans.span("generate", step=1) as span:
        span.set(tokens_out=3)
    spans.record("barrier_wait", 0.0, 1.0, workid=0)
    assert not spans.enabled() and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enable": True, "steps": ["x"]}, "profiling.steps[0]"),
        ({"enable": True, "flush_interval_s": 0}, "profiling.flush_interval_s"),
        ({"enable": True, "directory": "x"}, "profiling.directory: unknown key"),
    ],
)
def test_bad_profiling_config_names_the_key(section, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spans.configure(parse_sections({"profiling": section}, registry().sections), worker=0)


def test_profiling_enabled_without_the_plugin_says_what_to_install(monkeypatch):
    from skip_core import plugins

    monkeypatch.setenv("SKIP_PLUGINS", "")
    plugins._reset_for_tests()
    try:
        hint = r"install skip-plugin-profiling from a clone .*: pip install \./plugins/profiling"
        with pytest.raises(ConfigError, match=hint):
            spans.configure(parse_sections({"profiling": {"enable": True}}, registry().sections), worker=0)
    finally:
        monkeypatch.delenv("SKIP_PLUGINS")
        plugins._reset_for_tests()


def test_tool_calls_and_tool_rewards_nest_in_their_turns_and_requests(tiny_model_dir, tmp_path):
    """A scripted model (calls the calculator twice, then answers) with real tools and agent loop."""
    from scripted_model import ScriptedBackend, call, make_loop, prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = {0: call("12 * 34"), 1: call("408 + 1"), 2: "Answer: 409"}
    loop = make_loop(tokenizer, ScriptedBackend(tokenizer, lambda q, turn: script[turn]), n=2)
    recorder = Recorder(tmp_path, worker=0, flush_interval_s=60)
    spans.attach(recorder)
    try:
        loop.generate_sequences(prompts(tokenizer, ["What is 12 * 34 + 1?"] * 3, global_steps=4))
    finally:
        loop.shutdown()
        spans.close()
    rows = lines(tmp_path / "step_4" / "worker_0.jsonl")
    index = by_id(rows)
    calls = [row for row in rows if row["event"] == "tool_call"]
    assert len(calls) == 6 * 2 and {row["extra"]["tool"] for row in calls} == {"calculator"}
    assert sorted(Counter((r["extra"]["request_id"], r["extra"]["turn"]) for r in calls).values()) == [1] * 12
    assert {r["extra"]["turn"] for r in calls} == {1, 2}  # the third turn answers without a call
    for row in calls:
        assert index[row["parent_id"]]["event"] == "turn"
        assert index[row["parent_id"]]["extra"]["turn"] == row["extra"]["turn"]
    rewards = [row for row in rows if row["event"] == "tool_reward"]
    assert len(rewards) == 6 and all(index[row["parent_id"]]["event"] == "request" for row in rewards)
    generate = [row for row in rows if row["event"] == "generate"]
    assert len(generate) == 18 and {row["extra"]["finish_reason"] for row in generate} == {"stop"}
    assert all(row["extra"]["tokens_out"] > 0 and row["extra"]["tokens_in"] > 0 for row in generate)


def test_report_of_a_real_rollout(tiny_model_dir, tmp_path):
    args = [
        "rollout", "--config-dir", str(CONFIGS), *SMALL, f"task.dir={tiny_model_dir.parent}",
        "profiling.enable=true", f"profiling.dir={tmp_path / 'profile'}", f"output_dir={tmp_path / 'out'}",
    ]  # fmt: skip
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["profile", "report", str(tmp_path / "profile")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    md = (tmp_path / "profile" / "report" / "report.md").read_text()
    findings = md.split("## Findings", 1)[1].split("\n## ", 1)[0]
    assert "straggler" not in findings and not re.search(r"(?<![\d.])0(\.0+)? s\b", findings)
    assert "One rollout worker: nothing to compare" in md
