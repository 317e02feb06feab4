"""skip-plugin-profiling analysis side: reading logs, the analyses, findings, report, trace, CLI.

Each test writes small synthetic logs with planted facts (a straggler, a slow tool, a long
tail, known turn counts) and checks that the analyses name them.
"""

import collections
import html
import itertools
import json
import math
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np
import pyarrow.compute as pc
import pytest
from click.testing import CliRunner
from skip_plugin_profiling import analysis
from skip_plugin_profiling.cli import profile, register
from skip_plugin_profiling.evidence import MIN_COUNT, MIN_STEPS
from skip_plugin_profiling.intervals import union_length
from skip_plugin_profiling.logs import read_logs
from skip_plugin_profiling.report import FIGURES, write_report
from skip_plugin_profiling.trace import write_trace

T0 = 1_700_000_000.0


class Spans:
    """Writes spans the way the recorder does: ``{root}/step_{k}/worker_{r}.jsonl``, times in
    seconds from ``T0``, ``extra`` holding the request context and attributes. Every process
    has pid 4242 and counts span ids from 1, as containers on separate nodes may."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ids = collections.defaultdict(lambda: itertools.count(1))

    def span(self, step, workid, event, start, end, *, file=None, parent=0, request_id=None, turn=None, **attrs):
        file = workid if file is None else file
        span_id = next(self.ids[file])
        extra = {"request_id": request_id, "turn": turn, **attrs}
        line = {
            "timestamp": datetime.fromtimestamp(T0 + end).isoformat(),
            "event": event,
            "duration_sec": end - start,
            "workid": workid,
            "step": step,
            "phase": "train",
            "start": T0 + start,
            "pid": 4242,
            "span_id": span_id,
            "parent_id": parent,
            "extra": {k: v for k, v in extra.items() if v is not None},
        }
        folder = self.root / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"worker_{file}.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        return span_id

    def request(self, step, workid, rid, start, turns, tool="tool_reward", tool_s=0.5):
        """A request of ``turns`` (generate seconds, tokens_out) turns, then its tool reward."""
        end = start + sum(g for g, _ in turns) + tool_s
        parent = self.span(step, workid, "request", start, end, request_id=rid, turns=len(turns))
        t = start
        for k, (seconds, tokens) in enumerate(turns, 1):
            turn = self.span(step, workid, "turn", t, t + seconds, parent=parent, request_id=rid, turn=k)
            self.span(step, workid, "generate", t, t + seconds, parent=turn, request_id=rid, turn=k, tokens_out=tokens)
            t += seconds
        self.span(step, workid, tool, t, end, parent=parent, request_id=rid, tool="calc")
        return end

    def worker_step(self, step, workid, completions, start=0.0):
        """Requests (one turn each) ending at the given seconds, inside the worker's rollout span."""
        end = max(completions)
        for i, done in enumerate(completions):
            self.request(step, workid, f"s{step}w{workid}r{i}", start, [(done - start - 0.5, 100)])
        self.span(step, workid, "rollout", start, end, requests=len(completions))
        return end

    def barrier(self, step, ends):
        last = max(ends.values())
        for workid, end in ends.items():
            self.span(step, workid, "barrier_wait", end, last, file=-1)
        self.span(step, -1, "trainer/gen", 0.0, last + 0.5)
        self.span(step, -1, "trainer/update_actor", last + 0.5, last + 10.5)


NORMAL = [3.75 * k for k in range(1, 9)] + [45.0, 60.0]  # 80% done by 30 s of 60 s
PEAK_FAST = [3.0 * k for k in range(1, 11)]  # the other workers on step 7: done by 30 s
PEAK_SLOW = [5.0, 10.0, 15.0, 20.0, 25.0, 175.0, 176.0, 177.0, 178.0, 180.0]  # worker 0 on step 7


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 workers, steps 1-8; step 7 is a 3× peak where worker 0 straggles by 150 s."""
    root = tmp_path_factory.mktemp("run")
    spans = Spans(root)
    for step in range(1, 9):
        offset = (step - 1) * 1000.0
        ends = {}
        for w in range(8):
            done = (PEAK_SLOW if w == 0 else PEAK_FAST) if step == 7 else NORMAL
            ends[w] = spans.worker_step(step, w, [offset + d for d in done], start=offset)
        spans.barrier(step, ends)
    return read_logs(root)


def test_step_7_is_a_peak_and_worker_0_its_straggler(run):
    times = analysis.rollout_times(run)
    assert times.peaks == [7]
    ratio = dict(zip(times.table["step"].to_pylist(), times.table["ratio"].to_pylist(), strict=True))[7]
    assert ratio == pytest.approx(3.0)

    workers = analysis.workers(run)  # defaults to the slowest step
    assert workers.step == 7 and workers.straggler == 0
    assert workers.lag == pytest.approx(150.0) and not workers.balanced
    assert workers.mean_wait_others == pytest.approx(150.0) and workers.max_wait_others == pytest.approx(150.0)
    table = {row["workid"]: row for row in workers.table.to_pylist()}
    assert table[0]["busy"] == pytest.approx(180.0) and table[0]["wait"] == pytest.approx(0.0)
    assert table[0]["finish"] == pytest.approx(180.0) and table[1]["finish"] == pytest.approx(30.0)
    assert table[0]["gap"] == pytest.approx(150.0) and table[0]["gap_flagged"]
    assert (table[0]["gap_from"], table[0]["gap_to"]) == pytest.approx((25.0, 175.0))
    assert not any(table[w]["gap_flagged"] for w in range(1, 8))
    assert all(table[w]["requests"] == 10 for w in range(8))

    found = analysis.findings(run)
    (peak,) = [f for f in found if f.kind == "peak"]
    assert peak.step == 7 and peak.ratio == pytest.approx(3.0)
    (straggler,) = [f for f in found if f.kind == "straggler"]
    assert (straggler.step, straggler.worker) == (7, 0) and straggler.seconds == pytest.approx(150.0)
    assert straggler.values["mean_wait"] == pytest.approx(150.0)
    (gap,) = [f for f in found if f.kind == "gap"]
    assert (gap.worker, gap.step) == (0, 7) and gap.seconds == pytest.approx(150.0)
    assert "worker 0 for 150 s (from 25 s to 175 s" in gap.text


def test_the_straggler_is_whom_the_others_waited_for_not_the_busiest(tmp_path):
    spans = Spans(tmp_path)
    # worker 1 got its batch 30 s late: the least busy, yet the last to finish.
    ends = {w: spans.worker_step(1, w, [10.0 * k + start for k in range(1, n + 1)], start=start)
            for w, start, n in ((0, 10.0, 5), (1, 30.0, 4), (2, 0.0, 5))}  # fmt: skip
    spans.barrier(1, ends)
    workers = analysis.workers(read_logs(tmp_path))
    busy = dict(zip(workers.table["workid"].to_pylist(), workers.table["busy"].to_pylist(), strict=True))
    assert busy == pytest.approx({0: 50.0, 1: 40.0, 2: 50.0})
    assert workers.straggler == 1 and workers.lag == pytest.approx(15.0)  # the others waited 10 and 20 s
    assert workers.table["finish"].to_pylist() == pytest.approx([60.0, 70.0, 50.0])


def test_long_tail_80_percent_within_half_the_rollout(run):
    done = analysis.completion(run)
    assert done.headline_pct == pytest.approx(50.0)
    row = done.table.filter(pc.equal(done.table["step"], 1)).to_pylist()[0]
    assert row["requests"] == 80 and row["rollout_time"] == pytest.approx(60.0)
    assert row["t80_s"] == pytest.approx(30.0) and row["t80_pct"] == pytest.approx(50.0)
    assert row["t99_s"] == pytest.approx(60.0)
    (tail,) = [f for f in analysis.findings(run) if f.kind == "long_tail"]
    assert tail.share == pytest.approx(0.5) and "first 50% of the rollout" in tail.text


def test_trainer_phases_per_step(run):
    phases = analysis.trainer_phases(run)
    assert phases.table.column_names == ["step", "total", "gen", "update_actor", "other"]
    assert phases.table["step"].to_pylist() == list(range(1, 9))
    assert phases.table["update_actor"].to_pylist() == pytest.approx([10.0] * 8)
    assert phases.table["other"].to_pylist() == pytest.approx([0.0] * 8)  # no trainer/step: total = first to last


@pytest.fixture
def slow_tool(tmp_path):
    spans = Spans(tmp_path)
    ends = {0: 0.0, 1: 0.0}
    for i in range(6):
        ends[i % 2] = max(ends[i % 2], spans.request(1, i % 2, f"r{i}", 0.0, [(2.0 + i, 50)] * 2))
    ends[1] = spans.request(1, 1, "<b>slow</b>", 1.0, [(2.0, 50), (3.2, 60)], tool_s=40.0)
    for w, end in ends.items():
        spans.span(1, w, "rollout", 0.0, end)
    spans.barrier(1, ends)
    return tmp_path


def test_slowest_request_is_named_with_its_dominant_event(slow_tool):
    logs = read_logs(slow_tool)
    slowest = analysis.slowest_requests(logs, top=3)
    assert [r.request_id for r in slowest] == ["<b>slow</b>", "r5", "r4"]
    first = slowest[0]
    assert first.duration == pytest.approx(45.2) and first.workid == 1
    assert first.dominant_event == "tool_reward" and first.dominant_seconds == pytest.approx(40.0)
    assert [e["event"] for e in first.events][:3] == ["request", "turn", "generate"]
    assert first.events[-1]["attrs"]["tool"] == "calc"
    (finding,) = [f for f in analysis.findings(logs) if f.kind == "slow_request"]
    assert finding.request_id == "<b>slow</b>" and finding.event == "tool_reward"
    assert "tool_reward took 40 s of it" in finding.text and "took 45.2 s" in finding.text


def test_event_outliers_judge_engine_calls_per_token(tmp_path):
    spans = Spans(tmp_path)
    # 0.02 s per token, a long answer included; "stuck" took 60 s for 100 tokens; one reward took 40 s.
    for i, tokens in enumerate([50, 80, 100, 120, 150, 90, 110, 5000]):
        spans.request(1, 0, f"r{i}", 0.0, [(0.02 * tokens, tokens)], tool_s=0.03 + 0.001 * i)
    spans.request(1, 0, "stuck", 0.0, [(60.0, 100)], tool_s=0.03)
    spans.request(1, 0, "slow-reward", 0.0, [(2.0, 100)], tool_s=40.0)
    spans.span(1, 0, "rollout", 0.0, 100.0)
    outliers = analysis.event_outliers(read_logs(tmp_path))
    assert outliers.per_token == {"generate": True, "tool_reward": False}
    got = [(r["event"], r["request_id"]) for r in outliers.table.to_pylist()]
    assert got == [("generate", "stuck"), ("tool_reward", "slow-reward")]  # the 5000-token answer is no outlier
    (stuck,) = outliers.table.filter(pc.equal(outliers.table["event"], "generate")).to_pylist()
    assert stuck["usual"] == pytest.approx(2.0) and stuck["ratio"] == pytest.approx(30.0)


def test_event_shares_split_concurrent_spans_and_add_up(tmp_path):
    spans = Spans(tmp_path)
    # worker 0: busy 10 s, waits 2 s. generate a [0, 6] and b [2, 8] overlap each other and c's tool
    # call [5, 7]: each instant is split among the spans open at it; nothing runs in [9, 10].
    agent = spans.span(1, 0, "agent_step", 0.0, 8.0)
    spans.span(1, 0, "generate", 0.0, 6.0, parent=agent, request_id="a")
    spans.span(1, 0, "generate", 2.0, 8.0, parent=agent, request_id="b")
    spans.span(1, 0, "tool_call", 5.0, 7.0, request_id="c")
    spans.span(1, 0, "tool_call", 8.0, 9.0, request_id="b")
    spans.span(1, 0, "rollout", 0.0, 10.0)
    # worker 1: busy 12 s generating, no wait, no tool call.
    spans.span(1, 1, "generate", 0.0, 12.0, request_id="d")
    spans.span(1, 1, "rollout", 0.0, 12.0)
    spans.barrier(1, {0: 10.0, 1: 12.0})
    shares = analysis.event_shares(read_logs(tmp_path))
    assert "agent_step" in shares.containers and "rollout" in shares.containers
    got = {row["event"]: row["mean_share"] for row in shares.table.to_pylist()}
    assert set(got) == {"generate", "tool_call", "barrier_wait", "other/idle"}
    generate0 = 2 + 3 + 2 / 3 + 1 / 2 + 1  # [0,2] a; [2,5] a+b; [5,6] a+b+c; [6,7] b+c; [7,8] b
    assert got["generate"] == pytest.approx((generate0 / 12 + 12 / 12) / 2)
    assert got["tool_call"] == pytest.approx(((1 / 3 + 1 / 2 + 1) / 12 + 0) / 2)
    assert got["barrier_wait"] == pytest.approx((2 / 12 + 0) / 2)
    assert got["other/idle"] == pytest.approx((1 / 12 + 0) / 2)
    assert sum(got.values()) == pytest.approx(1.0)
    assert shares.table["event"].to_pylist()[0] == "generate" and shares.table["event"].to_pylist()[-1] == "other/idle"
    per_step = shares.per_step.to_pylist()
    events = {k: v for k, v in got.items() if k != "other/idle"}
    assert {r["event"]: r["share"] for r in per_step} == pytest.approx(events)


def test_turns_by_index_by_count_and_distribution(tmp_path):
    spans = Spans(tmp_path)
    plan = {"a": [1.0], "b": [1.0], "c": [1.0], "d": [1.0, 2.0], "e": [1.0, 2.0], "f": [1.0, 2.0, 3.0]}
    for rid, gens in plan.items():
        spans.request(1, 0, rid, 0.0, [(g, 10) for g in gens], tool_s=1.0)
    spans.span(1, 0, "rollout", 0.0, 7.0)
    turns = analysis.turns(read_logs(tmp_path))
    assert turns.by_turn.select(["turn", "mean_generate", "calls"]).to_pylist() == [
        {"turn": 1, "mean_generate": 1.0, "calls": 6},
        {"turn": 2, "mean_generate": 2.0, "calls": 3},
        {"turn": 3, "mean_generate": 3.0, "calls": 1},
    ]
    by_count = {r["turns"]: r["mean_duration"] for r in turns.by_count.to_pylist()}
    assert by_count == pytest.approx({1: 2.0, 2: 4.0, 3: 7.0})
    shares = {r["turns"]: r["share"] for r in turns.distribution.to_pylist()}
    assert shares == pytest.approx({1: 0.5, 2: 1 / 3, 3: 1 / 6})


def requests_by_turns(spans, counts, step=1):
    """``counts[k]`` requests of k turns, each turn 1 s of engine time, one rollout worker."""
    i = 0
    for turns, n in counts.items():
        for _ in range(n):
            spans.request(step, 0, f"s{step}r{i}", 0.01 * i, [(1.0, 10)] * turns, tool_s=0.0)
            i += 1
    spans.span(step, 0, "rollout", 0.0, 10.0)


def test_a_turn_ratio_names_its_counts_and_leaves_out_thin_sides(tmp_path):
    spans = Spans(tmp_path)
    requests_by_turns(spans, {1: 3, 2: 12, 3: 61})  # 3 one-turn requests: too few to compare with
    found = analysis.findings(read_logs(tmp_path))
    (turns,) = [f for f in found if f.kind == "turns"]
    assert (turns.values["turns"], turns.values["baseline_turns"]) == (3, 2) and turns.ratio == pytest.approx(1.5)
    assert "1.5× those with 2 turns (2 s; n=61 vs n=12 requests)." in turns.text
    (left,) = [f for f in found if f.kind == "left_out"]
    assert left.values == {"finding": "turns", "requests": {1: 3}}
    assert "1 turn (n=3)" in left.text and f"at least {MIN_COUNT} requests on each side" in left.text
    assert found[-1] is left  # what was not stated comes after what was


def test_no_turn_ratio_rests_on_three_requests(tmp_path):
    spans = Spans(tmp_path)
    requests_by_turns(spans, {1: 3, 3: 61})
    found = analysis.findings(read_logs(tmp_path))
    assert not [f for f in found if f.kind == "turns" or ("×" in f.text and "turn" in f.text)]
    assert [f.values["finding"] for f in found if f.kind == "left_out"] == ["turns"]


def test_a_peak_needs_enough_steps_for_its_median(tmp_path):
    spans = Spans(tmp_path)
    for step, seconds in ((1, 10.0), (2, 10.0), (3, 30.0)):
        spans.worker_step(step, 0, [100.0 * step + seconds], start=100.0 * step)
    found = analysis.findings(read_logs(tmp_path))
    assert not [f for f in found if f.kind == "peak"]
    (left,) = [f for f in found if f.kind == "left_out" and f.values["finding"] == "peak"]
    assert left.values["left_out"] == [3] and "step 3 (3.0×)" in left.text and f"fewer than {MIN_STEPS}" in left.text


def test_every_stated_ratio_names_the_counts_behind_it(run, slow_tool):
    """Peaks, the long tail and turn ratios say n=… vs n=…; so the sentences docs/quickstart.md quotes."""
    found = {f.kind: f for f in analysis.findings(run)}
    assert "(n=1 vs n=8 steps; threshold" in found["peak"].text
    first, last = found["long_tail"].values["requests"]  # the 80% and the 20%: ties at the 80% point go first
    assert first + last == 640 and last >= 8 * MIN_COUNT and found["long_tail"].values["left_out_steps"] == 0
    assert f"remaining 50% (median over 8 steps; n={first} vs n={last} requests)." in found["long_tail"].text
    small = analysis.findings(read_logs(slow_tool))  # 7 requests: no long tail to speak of
    (left,) = [f for f in small if f.kind == "left_out"]
    assert left.values["finding"] == "long_tail" and "The long tail is not stated" in left.text
    assert not [f for f in small if f.kind == "long_tail"]


def test_tail_advisor_on_a_hand_made_case(tmp_path):
    spans = Spans(tmp_path)
    # 0.1 s per generated token everywhere; r4's 1000 tokens make the step last 100 s.
    for rid, tokens in [("r1", 100), ("r2", 200), ("r3", 300), ("r4", 1000)]:
        spans.request(1, 0, rid, 0.0, [(tokens / 10, tokens)], tool_s=0.0)
    spans.span(1, 0, "rollout", 0.0, 100.0)
    advice = analysis.tail_advisor(read_logs(tmp_path), lengths=[300], drops=(0.25,))
    assert advice.total_rollout == pytest.approx(100.0)
    (cap,) = [r for r in advice.caps.to_pylist() if r["length"] == 300]
    # r4 capped at 300 tokens: 100 s - 700 tokens × 0.1 s = 30 s, so the step ends at 30 s instead of 100 s.
    assert cap["truncated_share"] == pytest.approx(0.25)
    assert cap["saved_s"] == pytest.approx(70.0) and cap["saved_pct"] == pytest.approx(70.0)
    assert {r["label"] for r in advice.caps.to_pylist()} >= {"p50", "p99", "given"}
    (over,) = advice.oversample.to_pylist()
    # drop 25%: the step ends when 3 of 4 requests are done (30 s); 1/3 more requests stretch the 100 s
    # with an engine call running by 1/3 (the calls run side by side: 160 s of them, 100 s of wall time).
    assert over["saved_s"] == pytest.approx(70.0) and over["extra_requests_pct"] == pytest.approx(100 / 3)
    assert over["dropped"] == 1 and over["extra_time_s"] == pytest.approx(100.0 / 3)
    assert any("throughput" in a for a in advice.assumptions)


def test_tail_advisor_estimates_on_the_timeline_not_on_summed_spans(tmp_path):
    """Two steps of 16 s, 50 requests at once on each of two workers: 1600 s of summed spans."""
    spans = Spans(tmp_path)
    for step in (1, 2):
        offset = 100.0 * step
        for w in range(2):
            for r in range(50):
                took, tokens = (15.0, 1500) if r == 0 else (4.0 + 0.1 * r, 100)  # a long answer holds each worker
                spans.request(step, w, f"s{step}w{w}r{r}", offset, [(took, tokens)], tool_s=1.0 if r == 0 else 0.0)
            spans.span(step, w, "rollout", offset, offset + 16.0)
    advice = analysis.tail_advisor(read_logs(tmp_path), lengths=[500], drops=(0.2,))
    (over,) = advice.oversample.to_pylist()
    summed = 2 * 2 * (15.0 + sum(4.0 + 0.1 * r for r in range(1, 50)))  # what the old estimate multiplied
    assert advice.total_rollout == pytest.approx(32.0) and summed > 40 * advice.total_rollout
    assert over["extra_time_s"] == pytest.approx(0.25 * 2 * 15.0)  # engine calls ran 15 s per step
    assert over["extra_time_s"] <= 0.25 * advice.total_rollout
    # dropping the slowest 20 of each step's 100: the step ends with its 80th request, at 8 s
    assert over["dropped"] == 40 and over["saved_s"] == pytest.approx(2 * (16.0 - 8.0))
    for row in [*advice.caps.to_pylist(), over]:
        assert 0 <= row["saved_s"] <= advice.total_rollout and row["saved_pct"] <= 100
    (cap,) = [r for r in advice.caps.to_pylist() if r["length"] == 500]
    # each step's two answers of 1500 tokens, capped at 500, end at 6 s: the step's last then ends at 8.9 s
    assert cap["truncated"] == 4 and cap["saved_s"] == pytest.approx(2 * (16.0 - 8.9))


def test_overlapping_steps_are_saved_once(tmp_path):
    """An async schedule rolls out step 2 while step 1 still runs: cutting step 1's tail saves
    nothing while step 2's window covers that time."""
    spans = Spans(tmp_path)
    for r in range(10):  # step 1 over [0, 20]: r0 ends at 20 s, the others by 6.4 s
        spans.request(1, 0, f"a{r}", 0.5 * r, [(20.0 if r == 0 else 1.0 + 0.1 * r, 10)], tool_s=0.0)
    for r in range(10):  # step 2 over [5, 30]: its requests end at 21, 22, ... 30 s
        spans.request(2, 0, f"b{r}", 5.0 + 0.5 * r, [(16.0 + 0.5 * r, 10)], tool_s=0.0)
    advice = analysis.tail_advisor(read_logs(tmp_path), drops=(0.1,))
    assert advice.total_rollout == pytest.approx(30.0)  # [0, 20] and [5, 30] on the wall clock, not 20 + 25
    (over,) = advice.oversample.to_pylist()
    # dropping each step's slowest request: step 1 would end at 5.8 s (14.2 s earlier, but step 2 runs
    # then), step 2 at 29 s: 1 s off the timeline, not 15.2 s
    assert over["dropped"] == 2 and over["saved_s"] == pytest.approx(1.0)
    assert over["extra_time_s"] == pytest.approx(30.0 / 9)  # generation covered all 30 s


def test_a_requests_concurrent_engine_calls_take_their_time_once(tmp_path):
    """Two calls of one request side by side (parallel sampling): 1000 tokens in 10 s of wall
    time, so cutting 500 tokens saves 5 s, not the 10 s that 20 s of summed calls would say."""
    spans = Spans(tmp_path)
    request = spans.span(1, 0, "request", 0.0, 10.0, request_id="r", turns=1)
    for _ in range(2):
        spans.span(1, 0, "generate", 0.0, 10.0, parent=request, request_id="r", turn=1, tokens_out=500)
    advice = analysis.tail_advisor(read_logs(tmp_path), lengths=[500], drops=())
    (cap,) = [r for r in advice.caps.to_pylist() if r["length"] == 500]
    assert advice.total_rollout == pytest.approx(10.0) and cap["saved_s"] == pytest.approx(5.0)


class ArticleLogger:
    """The article's logger, as it writes: one ordered dict per line, line-buffered file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115

    def log(self, event, duration_sec=None, extra=None, workid=None, step=None, **kwargs):
        record = collections.OrderedDict()
        record["timestamp"] = datetime.now().isoformat()
        record["event"] = event
        if duration_sec is not None:
            record["duration_sec"] = duration_sec
        if extra:
            record["extra"] = extra
        if workid is not None:
            record["workid"] = workid
        if step is not None:
            record["step"] = step
        record.update(kwargs)
        self.file.write(json.dumps(record) + "\n")


def test_reads_the_article_format_with_a_truncated_last_line(tmp_path):
    for w in range(2):
        logger = ArticleLogger(tmp_path / "step_3" / f"worker_{w}.jsonl")
        logger.log("preprocessing_duration", 0.25, workid=w, step=3)
        for r in range(3):
            for turn in range(r + 1):  # request r has r + 1 turns
                logger.log("engine_async_generate", 0.5 - 0.1 * turn, {"request_id": f"w{w}r{r}"}, workid=w, step=3)
        logger.log("async_generate_duration", 2.0, workid=w, step=3)
        logger.log("request_start", extra={"request_id": f"w{w}r0"}, workid=w, step=3)  # an instant
        logger.log("barrier_wait_duration", 0.1 * w, workid=w, step=3)
        logger.log("total_step_duration", 3.0, workid=w, step=3, batch_size=3)
        logger.file.write('{"timestamp": "2026-11-22T10:00:00.1", "event": "engine_async_gen')  # killed mid-line
        logger.file.close()
    variant = ArticleLogger(tmp_path / "step_4" / "worker_0.jsonl")  # `worker` key, no step: from the directory
    variant.log("calc_reward", 1.5, worker=0)
    variant.file.write("not json at all\n")
    variant.file.close()

    logs = read_logs(tmp_path)
    assert logs.lines_skipped == 3 and len(logs.files) == 3 and logs.instants == 2
    assert len(logs.line_by_line) == 1
    table = logs.table
    assert table.num_rows == 2 * (1 + 6 + 3) + 1
    events = collections.Counter(zip(table["event"].to_pylist(), table["raw_event"].to_pylist(), strict=True))
    assert events[("generate", "engine_async_generate")] == 12
    assert events[("rollout", "total_step_duration")] == 2
    assert events[("preprocess", "preprocessing_duration")] == 2
    assert events[("async_generate", "async_generate_duration")] == 2
    reward = table.filter(pc.equal(table["event"], "tool_reward")).to_pylist()[0]
    assert (reward["step"], reward["workid"], reward["phase"]) == (4, 0, "train")
    assert reward["start"] == pytest.approx(reward["end"] - 1.5)
    first = json.loads((tmp_path / "step_3" / "worker_0.jsonl").read_text().splitlines()[0])
    row = table.filter(pc.equal(table["event"], "preprocess")).to_pylist()[0]
    naive_as_utc = datetime.fromisoformat(first["timestamp"]).replace(tzinfo=timezone.utc).timestamp()
    assert row["end"] == pytest.approx(naive_as_utc, abs=1e-6)
    assert "batch_size" in table.column_names

    turns = {r["turns"]: r["share"] for r in analysis.turns(logs).distribution.to_pylist()}
    assert turns == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    assert analysis.completion(logs).table["requests"].to_pylist() == [6]
    assert any(f.kind == "skipped_lines" for f in analysis.findings(logs))


def test_reads_one_file_and_validation_steps(tmp_path):
    spans = Spans(tmp_path)
    spans.request(2, 0, "r", 0.0, [(1.0, 5)])
    val = tmp_path / "val_step_2" / "worker_0.jsonl"
    val.parent.mkdir()
    val.write_text(json.dumps({"timestamp": "2026-01-01T00:00:01", "event": "generate", "duration_sec": 1.0}) + "\n")
    (tmp_path / "metrics.jsonl").write_text('{"event": "not a span", "duration_sec": 1, "timestamp": "2026-01-01"}\n')
    mixed = tmp_path / "step_2" / "worker_1.jsonl"  # `tool` changes type: pyarrow refuses, json.loads reads it
    mixed.write_text("".join(json.dumps({**line, "timestamp": "2026-01-01T00:00:01+00:00"}) + "\n" for line in (
        {"event": "tool_call", "duration_sec": 1, "extra": {"tool": 3}},
        {"event": "tool_call", "duration_sec": 2.5, "extra": {"tool": "calc"}},
    )))  # fmt: skip
    logs = read_logs(tmp_path)
    assert logs.phases() == ["train", "val"] and logs.steps("val") == [2]
    assert len(logs) == 4 + 1 + 2 and logs.line_by_line == [mixed] and logs.lines_skipped == 0
    tools = logs.table.filter(pc.equal(logs.table["event"], "tool_call"))
    assert tools["tool"].to_pylist()[-2:] == ["3", "calc"] and tools["workid"].to_pylist()[-2:] == [1, 1]
    assert tools["end"].to_pylist()[-1] == datetime(2026, 1, 1, 0, 0, 1, tzinfo=timezone.utc).timestamp()
    one = read_logs(tmp_path / "step_2" / "worker_0.jsonl")
    assert len(one) == 4 and one.steps() == [2]


def test_report_writes_every_figure_and_the_findings(run, slow_tool, tmp_path):
    index = write_report(run, tmp_path / "report", top=3)
    for name in FIGURES:
        assert (tmp_path / "report" / f"{name}.png").stat().st_size > 1000, name
    page = index.read_text()
    assert "<h2>Findings</h2>" in page
    for finding in analysis.findings(run):
        assert html.escape(finding.text) in page
    assert "straggler" in page and '<img src="workers.png"' in page
    assert "Step 7" in (tmp_path / "report" / "report.md").read_text()

    escaped = write_report(read_logs(slow_tool), tmp_path / "escaped").read_text()
    assert "<b>slow</b>" not in escaped and "&lt;b&gt;slow&lt;/b&gt;" in escaped


def test_trace_has_a_process_per_worker_and_nests_on_every_lane(run, tmp_path):
    spans = Spans(tmp_path / "logs")
    spans.request(1, 0, "a", 0.0, [(2.0, 1), (1.0, 1)])
    spans.request(1, 0, "b", 1.0, [(2.0, 1)])  # concurrent with a: another lane
    spans.span(1, 0, "tool_call", 5.0, 7.0, request_id="b")  # partly overlaps b's next tool call
    spans.span(1, 0, "tool_call", 6.0, 8.0, request_id="b")
    spans.span(1, 0, "rollout", 0.0, 8.0)
    for logs, steps in ((run, None), (run, [7]), (read_logs(tmp_path / "logs"), None)):
        path = write_trace(logs, tmp_path / "trace.json", steps=steps)
        trace = json.loads(path.read_text())
        assert trace["displayTimeUnit"] == "ms"
        _assert_nested(trace["traceEvents"])
    lanes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert lanes == ["worker", "requests 1", "requests 2", "overflow 3"]  # b's second tool call overflows
    names = {e["pid"]: e["args"]["name"] for e in _events(run, tmp_path) if e["name"] == "process_name"}
    assert names == {0: "trainer", **{w + 1: f"rollout worker {w}" for w in range(8)}}
    spans = [e for e in _events(run, tmp_path, steps=[7]) if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {7}
    assert all(e["args"]["os_pid"] == 4242 and e["cat"] == "train" for e in spans)


def _events(logs, tmp_path, steps=None):
    return json.loads(write_trace(logs, tmp_path / "t.json", steps=steps).read_text())["traceEvents"]


def _assert_nested(events):
    lanes = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], int)
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends = []
        for start, end in spans:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "partial overlap on one lane"
            open_ends.append(end)


def test_trace_keeps_a_request_on_one_lane(tmp_path):
    spans = Spans(tmp_path)
    for i in range(3):  # three concurrent requests: three lanes
        spans.request(1, 0, f"r{i}", 0.1 * i, [(1.0, 1), (1.0, 1)])
    spans.span(1, 0, "rollout", 0.0, 3.0)
    events = _events(read_logs(tmp_path), tmp_path)
    lanes = collections.defaultdict(set)
    for e in events:
        if e["ph"] == "X":
            lanes[e["args"].get("request_id")].add(e["tid"])
    assert lanes[None] == {0}
    assert sorted(lanes[f"r{i}"].pop() for i in range(3)) == [1, 2, 3]


def invoke(*args):
    return CliRunner().invoke(profile, [str(a) for a in args], catch_exceptions=False)


def test_cli_report_and_trace(run, tmp_path):
    result = invoke("report", run.root, "--out", tmp_path / "r", "--step", 7, "--top", 2, "--max-response-length", 50)
    assert result.exit_code == 0, result.output
    assert f"Report: {tmp_path / 'r' / 'index.html'}" in result.output
    assert "worker 0 was the straggler" in result.output and "events from 72 files" in result.output
    assert "analysed in" in result.output
    result = invoke("trace", run.root, "-o", tmp_path / "t.json", "--step", 7)
    assert result.exit_code == 0 and json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_cli_errors_are_clear(run, tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke("report", tmp_path / "empty")
    assert result.exit_code == 1 and "no profiling logs" in result.output
    result = invoke("report", run.root, "--step", 99, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "step 99" in result.output and "1, 2, 3, 4, 5, 6, 7, 8" in result.output
    result = invoke("trace", run.root, "--step", 99, "-o", tmp_path / "t.json")
    assert result.exit_code == 1 and "steps available: 1, 2, 3" in result.output


def test_register_adds_the_profile_group():
    group = click.Group("skip")
    register(group)
    assert "profile" in group.commands and set(group.commands["profile"].commands) == {"report", "trace"}


def test_union_length_is_exact_on_nested_and_disjoint_intervals():
    groups = np.array([0, 0, 0, 1, 1, 2])
    starts = np.array([0.0, 1.0, 5.0, 0.0, 3.0, 2.0])
    ends = np.array([4.0, 2.0, 6.0, 2.0, 4.0, 2.0])
    got = union_length(groups, starts, ends, 4)
    assert got.tolist() == pytest.approx([5.0, 3.0, 0.0, 0.0])
    assert not math.isnan(got.sum())
