"""`skip profile report` on logs in the article's own format, with planted facts.

The logs are written here the way the article's ``SGLangLogManager`` writes them: per rollout
worker ``step_{k}/worker_{r}.jsonl``, one line when an event ends, keys in the logger's order
(``timestamp`` of the end in naive local ISO time, ``event``, ``duration_sec``, ``extra``,
``workid``, ``step``), per-request events carrying ``extra.request_id``, and per request an
``async_rollout_request_complete`` whose duration is the request's whole time.

Planted: 8 workers, 6 steps of about a minute; on step 4 four requests of worker 5 stall for
107 s in their second engine call while the other seven workers wait at the barrier (a peak
step and its straggler); on step 2 one request's ``calc_reward`` takes 40 s where rewards take
10-50 ms, and ends well before its step does.
"""

import json
import random
from datetime import datetime
from pathlib import Path

import pytest
from skip_plugin_profiling import analysis
from skip_plugin_profiling.logs import read_logs
from skip_plugin_profiling.report import write_report

T0 = 1_700_000_000.0
WORKERS, STEPS, REQUESTS = 8, 6, 16
STRAGGLER, PEAK_STEP, STALL_S = 5, 4, 107.0
SLOW_REWARD = ("s2-w2-r7", 2, 2)  # request id, step, worker
STEP_GAP_S = 400.0


def article_line(event: str, end: float, duration: float | None, workid: int, step: int, extra=None) -> str:
    """One line as the article's logger formats it (``json.dumps`` of its ordered dict)."""
    entry = {"timestamp": datetime.fromtimestamp(T0 + end).isoformat(), "event": event}
    if duration is not None:
        entry["duration_sec"] = duration
    if extra is not None:
        entry["extra"] = extra
    entry["workid"], entry["step"] = workid, step
    return json.dumps(entry)


class Worker:
    """One worker's step: events collected as (end, line) and written in the order they ended."""

    def __init__(self, step: int, workid: int, t0: float) -> None:
        self.step, self.workid, self.t0, self.lines = step, workid, t0, []

    def log(self, event: str, start: float, end: float, extra=None) -> None:
        line = article_line(event, self.t0 + end, end - start, self.workid, self.step, extra)
        self.lines.append((end, line))

    def write(self, root: Path) -> None:
        folder = root / f"step_{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"worker_{self.workid}.jsonl").open("a", buffering=1) as out:
            for _, line in sorted(self.lines, key=lambda pair: pair[0]):
                out.write(line + "\n")


def request(w: Worker, rng: random.Random, rid: str, begin: float, stall: float, reward: float, quick: bool) -> float:
    """Two turns of engine call + tool call, the reward, then the completion marker."""
    t = begin
    for turn in range(2):
        generate = (0.5 if quick else rng.uniform(10.0, 25.0)) + (stall if turn == 1 else 0.0)
        w.log("engine_async_generate", t, t + generate, {"request_id": rid, "turn": turn})
        t += generate
        tool = rng.uniform(0.2, 0.5)
        w.log("tool_call", t, t + tool, {"request_id": rid, "turn": turn + 1})
        t += tool
    w.log("calc_reward", t, t + reward, {"request_id": rid})
    t += reward
    w.log("async_rollout_request_complete", begin, t, {"request_id": rid, "turns": 2, "finish_reason": "stop"})
    return t


def write_article_logs(root: Path, total_step: bool = True) -> None:
    """``total_step``: log each worker's ``total_step_duration`` (the article's analysis script
    divides by it; its text does not mention it). Without it a worker's only stretch is from its
    preprocessing to its concatenation, which holds its barrier wait."""
    rng = random.Random(7)
    for step in range(1, STEPS + 1):
        t0 = (step - 1) * STEP_GAP_S
        workers, finished = [], []
        for workid in range(WORKERS):
            w = Worker(step, workid, t0)
            w.log("preprocessing_duration", 0.0, 0.5)
            done = 0.5
            for r in range(REQUESTS):
                rid = f"s{step}-w{workid}-r{r}"
                stalled = (step, workid) == (PEAK_STEP, STRAGGLER) and r < 4
                slow = (rid, step, workid) == SLOW_REWARD
                reward = 40.0 if slow else rng.uniform(0.01, 0.05)
                done = max(done, request(w, rng, rid, 0.5, STALL_S if stalled else 0.0, reward, quick=slow))
            workers.append(w)
            finished.append(done)
        last = max(finished) + 0.01
        for w, done in zip(workers, finished, strict=True):
            w.log("barrier_wait_duration", done, last)
            w.log("broadcast_duration", last, last + 0.05)
            w.log("padding_duration", last + 0.05, last + 0.15)
            w.log("concatenation_duration", last + 0.15, last + 0.16)
            if total_step:
                w.log("total_step_duration", 0.0, last + 0.16)
            w.write(root)


@pytest.fixture(scope="module", params=[True, False], ids=["total_step", "no_total_step"])
def article(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("article")
    write_article_logs(root, total_step=request.param)
    logs = read_logs(root)
    result = analysis.analyze(logs)
    return logs, result, analysis.findings(result)


def test_the_peak_step_and_its_straggler_are_named(article):
    _, result, found = article
    assert result.rollout.peaks == [PEAK_STEP] and result.step == PEAK_STEP
    (peak,) = [f for f in found if f.kind == "peak"]
    assert peak.step == PEAK_STEP and f"Step {PEAK_STEP}'s rollout took" in peak.text
    (straggler,) = [f for f in found if f.kind == "straggler"]
    assert (straggler.step, straggler.worker) == (PEAK_STEP, STRAGGLER)
    assert f"worker {STRAGGLER} was the straggler" in straggler.text and "worker 0" not in straggler.text
    assert straggler.values["mean_wait"] > STALL_S - 10
    assert not any(f.kind == "balanced" for f in found)
    table = {row["workid"]: row for row in result.workers.table.to_pylist()}
    assert table[STRAGGLER]["wait"] < 0.1 and all(table[w]["wait"] > STALL_S / 2 for w in table if w != STRAGGLER)
    assert all(row["busy"] < 60 for w, row in table.items() if w != STRAGGLER)  # waiting is not being busy


def test_a_step_without_a_straggler_is_balanced(article):
    logs, _, _ = article
    workers = analysis.workers(logs, step=1)
    assert workers.balanced and workers.straggler is None and workers.lag < workers.threshold
    (balanced,) = [f for f in analysis.findings(logs, step=1) if f.kind == "balanced"]
    assert balanced.step == 1 and "the 8 rollout workers finished together" in balanced.text


def test_the_slow_reward_is_named_by_request(article):
    _, result, found = article
    rid, step, workid = SLOW_REWARD
    outliers = [f for f in found if f.kind == "event_outlier" and f.event == "tool_reward"]
    assert len(outliers) == 1 and outliers[0].request_id == rid
    assert (outliers[0].step, outliers[0].worker) == (step, workid) and outliers[0].seconds == pytest.approx(40.0)
    assert "calc_reward" in outliers[0].text and rid in outliers[0].text
    assert outliers[0].values["count"] == 1  # one reward of 768 stands out; the rest are ordinary
    table = result.outliers.table.to_pylist()
    assert [r["request_id"] for r in table if r["event"] == "tool_reward"] == [rid]
    stalled = {r["request_id"] for r in table if r["event"] == "generate"}
    assert stalled == {f"s{PEAK_STEP}-w{STRAGGLER}-r{r}" for r in range(4)}


def test_the_completion_marker_is_not_an_event(article):
    logs, result, found = article
    events = set(logs.table["event"].to_pylist())
    assert "async_rollout_request_complete" not in events and "request" in events  # the marker, renamed
    assert "request" in result.shares.containers
    shares = {r["event"]: r["mean_share"] for r in result.shares.table.to_pylist()}
    assert "request" not in shares and "async_rollout_request_complete" not in shares
    assert sum(shares.values()) == pytest.approx(1.0) and all(0 <= s <= 1 for s in shares.values())
    assert all(r.dominant_event == "generate" for r in result.slowest)  # not the marker spanning each request
    for r in result.slowest[:4]:  # the four stalled requests
        assert r.request_id.startswith(f"s{PEAK_STEP}-w{STRAGGLER}-") and r.dominant_seconds > STALL_S
    assert all(f.event not in ("request", "async_rollout_request_complete") for f in found)
    (share,) = [f for f in found if f.kind == "event_share"]
    assert sum(share.values["shares"].values()) + share.values["rest"] == pytest.approx(1.0)
    assert sum(share.values["shares"].values()) <= 1.0


def test_requests_start_when_they_began_and_complete_with_their_marker(article):
    _, result, _ = article
    row = result.completion.table.to_pylist()[0]
    assert row["requests"] == WORKERS * REQUESTS
    turns = {r["turns"]: r["share"] for r in result.turns.distribution.to_pylist()}
    assert turns == {2: 1.0}  # from the marker's ``turns``, and two engine calls per request
    assert [r["turn"] for r in result.turns.by_turn.to_pylist() if r["step"] == 1] == [1, 2]


def test_report_md_names_them(article, tmp_path):
    logs, result, _ = article
    write_report(logs, tmp_path, analysis=result)
    md = (tmp_path / "report.md").read_text()
    findings = md.split("## Findings", 1)[1].split("\n## ", 1)[0]
    assert f"worker {STRAGGLER} was the straggler" in findings and f"Step {PEAK_STEP}'s rollout took" in findings
    assert SLOW_REWARD[0] in findings and "calc_reward" in findings
    assert "0.0 s" not in md and "async_rollout_request_complete" not in findings
    slowest = md.split(f"## Slowest requests of step {PEAK_STEP}", 1)[1].split("\n## ", 1)[0]
    assert SLOW_REWARD[0] in slowest and "Event outliers" in slowest
    flagged = result.outliers.table.num_rows
    assert f"Spans flagged: {flagged}." in slowest and f"span: {flagged}" not in slowest  # a count, named as one
    assert "`usual` is the time the event's median gives the span" in slowest
    assert (tmp_path / "workers.png").stat().st_size > 1000 and (tmp_path / "index.html").exists()
