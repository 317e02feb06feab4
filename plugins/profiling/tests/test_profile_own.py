"""`skip profile report` on logs our own profiler writes, as `make demo` produces them: one
rollout worker, a driver whose trainer phases nest (``trainer/step`` holds every phase,
``trainer/testing`` holds ``trainer/validate``), and events of micro- to milliseconds.

The spans are ``skip_core.spans.Span`` objects written by the plugin's ``Recorder`` (one per
process, as each Ray actor has one), with times set by hand so the facts are known; a slow
test also reports on a real `skip rollout`.
"""

import re
from pathlib import Path

import pytest
from skip_core.spans import Span
from skip_plugin_profiling import analysis
from skip_plugin_profiling.logs import read_logs
from skip_plugin_profiling.recorder import Recorder
from skip_plugin_profiling.report import write_report

T0 = 1_700_000_000.0
STEPS = (1, 2, 3)
TESTING_STEP = 3

ZERO_SECONDS = re.compile(r"(?<![\d.])0(\.0+)? s\b")  # "0 s", "0.0 s": what a tiny duration must not read as


def emit(recorder: Recorder, name: str, parent: Span | None, start: float, end: float, **attrs) -> Span:
    """A span of ``parent`` made by hand and handed to the recorder as if it had just ended."""
    span = Span(name, **attrs)
    span.parent, span.start, span.end = parent, T0 + start, T0 + end
    recorder.end(span)
    return span


def rollout(worker: Recorder, step: int, t0: float) -> float:
    """Eight requests of two turns: 50-120 ms engine calls, 40 µs tool calls but one of 5 ms
    (jitter: 125× the median, yet nothing worth a sentence); returns the end."""
    top = Span("rollout", step=step, phase="train", requests=8)
    top.parent, end = None, t0
    for r in range(8):
        rid = f"{step}-{r}"
        begin = t0 + 0.001 * r
        emit(worker, "preprocess", top, begin - 0.0002, begin, request_id=rid, offset=0)
        request = Span("request", request_id=rid, offset=0)
        request.parent, clock = top, begin
        for turn in (1, 2):
            took, tool = 0.05 + 0.01 * r + 0.02 * turn, 0.005 if (r, turn) == (3, 2) else 0.00004
            span = emit(worker, "turn", request, clock, clock + took + tool, turn=turn)
            emit(worker, "generate", span, clock, clock + took, tokens_out=10 + r, finish_reason="stop")
            emit(worker, "tool_call", span, clock + took, clock + took + tool, tool="calculator")
            clock += took + tool
        emit(worker, "tool_reward", request, clock, clock + 0.00002, tool="calculator")
        request.set(turns=2, response_tokens=20 + 2 * r)
        request.start, request.end = T0 + begin, T0 + clock + 0.00002
        worker.end(request)
        end = max(end, clock + 0.00002)
    emit(worker, "padding", top, end, end + 0.003, requests=8)
    top.start, top.end = T0 + t0, T0 + end + 0.003
    worker.end(top)
    return end + 0.003


def write_own_logs(root: Path) -> None:
    worker, driver = Recorder(root, worker=0, flush_interval_s=3600), Recorder(root, worker=-1, flush_interval_s=3600)
    clock = 0.0
    for step in STEPS:
        top = emit(driver, "trainer/step", None, clock, clock + 1.0, step=step)
        emit(driver, "trainer/data", top, clock, clock + 0.002)
        gen = emit(driver, "trainer/gen", top, clock + 0.002, clock + 0.4)
        done = rollout(worker, step, clock + 0.01)
        emit(driver, "barrier_wait", gen, done, done, workid=0)
        emit(driver, "batch_construction", gen, done, done + 0.001, workers=1)
        emit(driver, "trainer/reward", top, clock + 0.4, clock + 0.403)
        emit(driver, "trainer/update_actor", top, clock + 0.403, clock + 0.7)
        if step == TESTING_STEP:
            testing = emit(driver, "trainer/testing", top, clock + 0.7, clock + 0.98)
            emit(driver, "trainer/validate", testing, clock + 0.71, clock + 0.97, step=step, phase="val")
        clock += 2.0
    worker.close()
    driver.close()


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    write_own_logs(root / "profile")
    logs = read_logs(root / "profile")
    result = analysis.analyze(logs)
    return logs, result, analysis.findings(result)


def test_one_worker_has_no_straggler(own):
    _, result, found = own
    workers = result.workers
    assert workers.table["workid"].to_pylist() == [0]
    assert workers.straggler is None and workers.balanced is None
    assert not [f for f in found if f.kind in ("straggler", "balanced")]
    assert not any("straggler" in f.text for f in found)


def test_trainer_phases_keep_the_step_number_and_stack_to_the_step_time(own):
    _, result, _ = own
    phases = result.trainer
    table = phases.table
    assert table.column_names[:2] == ["step", "total"] and table.column_names.count("step") == 1
    assert table["step"].to_pylist() == list(STEPS)  # step numbers, not the trainer/step durations
    assert table["total"].to_pylist() == pytest.approx([1.0] * len(STEPS))  # those are here
    assert phases.nested == {"testing": ["validate"]}
    assert phases.phases == ["data", "gen", "reward", "update_actor", "testing", "validate"]
    for row in table.to_pylist():
        stacked = sum(v for k, v in row.items() if k not in ("step", "total"))
        assert stacked == pytest.approx(row["total"])  # exclusive times and ``other`` add up to the step
    last = table.to_pylist()[-1]
    assert last["validate"] == pytest.approx(0.26) and last["testing (excl. validate)"] == pytest.approx(0.02)
    assert last["other"] == pytest.approx(0.02)  # 0.98 to 1.0: the step outside every phase


def test_micro_jitter_is_no_outlier(own):
    _, result, found = own
    assert result.outliers.medians["tool_call"] == pytest.approx(0.00004, abs=1e-6)
    assert result.outliers.table.num_rows == 0 and not [f for f in found if f.kind == "event_outlier"]


def test_findings_use_units_that_fit_and_shares_that_add_up(own):
    _, result, found = own
    assert found
    for f in found:
        assert not ZERO_SECONDS.search(f.text), f.text
    (share,) = [f for f in found if f.kind == "event_share"]
    assert sum(share.values["shares"].values()) <= 1.0
    assert sum(share.values["shares"].values()) + share.values["rest"] == pytest.approx(1.0)
    assert re.search(r"\d ms\b", share.text)
    assert sum(result.shares.table["mean_share"].to_pylist()) == pytest.approx(1.0)


def test_report_md_of_one_worker(own, tmp_path):
    logs, result, _ = own
    write_report(logs, tmp_path, analysis=result)
    md = (tmp_path / "report.md").read_text()
    findings = md.split("## Findings", 1)[1].split("\n## ", 1)[0]
    assert "straggler" not in findings and not ZERO_SECONDS.search(findings)
    workers = md.split("## Workers on step", 1)[1].split("\n## ", 1)[0]
    assert "One rollout worker: nothing to compare" in workers
    trainer = md.split("## Trainer phases", 1)[1]
    assert "| step | total | data | gen |" in trainer
    assert [line.split("|")[1].strip() for line in trainer.splitlines() if re.match(r"\| \d", line)] == ["1", "2", "3"]
    assert (tmp_path / "workers.png").stat().st_size > 1000 and (tmp_path / "trainer.png").stat().st_size > 1000
