"""A worker log is input nobody checked: a crashed writer, a disk that filled, a file someone
edited. No line of it may kill ``skip profile report`` or ``skip profile trace``, and no line
may change what the lines around it yield.

The valid lines come from the plugin's own ``Recorder`` (one worker, two steps) plus a few in
the article's format (times from an ISO ``timestamp``, an instant without a duration).
"""

import collections
import json
import math
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from skip_core.cli import cli
from skip_core.spans import Span
from skip_plugin_profiling import analysis
from skip_plugin_profiling.logs import CORE, read_logs
from skip_plugin_profiling.recorder import Recorder
from skip_plugin_profiling.trace import write_trace

T0 = 1_700_000_000.0
ARTICLE = [
    {"timestamp": "2026-01-01T00:00:01.500000", "event": "engine_async_generate", "duration_sec": 0.5,
     "workid": 0, "step": 1, "extra": {"request_id": "a1", "tokens_out": 7}},
    {"timestamp": "2026-01-01T00:00:02.250000+00:00", "event": "calc_reward", "duration_sec": 0.25, "worker": 0},
    {"timestamp": "2026-01-01T00:00:02.500000", "event": "request_start", "extra": {"request_id": "a2"}},
]  # fmt: skip


def emit(recorder: Recorder, name: str, parent: Span | None, start: float, end: float, **attrs) -> Span:
    span = Span(name, **attrs)
    span.parent, span.start, span.end = parent, T0 + start, T0 + end
    recorder.end(span)
    return span


def valid_log(root: Path) -> Path:
    """``root/step_1/worker_0.jsonl`` and ``step_2``: three requests of two turns a step."""
    worker = Recorder(root, worker=0, flush_interval_s=3600)
    for step in (1, 2):
        t0 = 10.0 * step
        top = Span("rollout", step=step, phase="train", requests=3)
        top.parent = None
        for r in range(3):
            request = emit(worker, "request", top, t0, t0 + 2.5 + r, request_id=f"{step}-{r}", turns=2)
            for turn in (1, 2):
                begin = t0 + turn + 0.1 * r
                held = emit(worker, "turn", request, begin, begin + 0.9, turn=turn)
                emit(worker, "generate", held, begin, begin + 0.7, tokens_out=10 * r + turn, finish_reason="stop")
                emit(worker, "tool_call", held, begin + 0.7, begin + 0.9, tool="calculator")
        top.start, top.end = T0 + t0, T0 + t0 + 5.0
        worker.end(top)
    worker.close()
    with (root / "step_1" / "worker_0.jsonl").open("a") as log:
        log.writelines(json.dumps(line) + "\n" for line in ARTICLE)
    return root / "step_1" / "worker_0.jsonl"


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes]:
    """The valid log directory and the bytes of its step 1 file, which tests mix garbage into."""
    path = valid_log(tmp_path_factory.mktemp("valid") / "profile")
    return path.parent.parent, path.read_bytes()


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_an_integer_past_64_bits_does_not_kill_the_report(valid, tmp_path):
    _, lines = valid
    log = tmp_path / "profile" / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    huge = '{"timestamp": "2026-01-01T00:00:09", "event": "generate", "duration_sec": 1, "step": 1' + "0" * 22 + "}"
    log.write_bytes(lines + huge.encode() + b"\n")
    result = invoke("profile", "report", tmp_path / "profile", "--out", tmp_path / "report")
    assert result.exit_code == 0, result.output  # was: OverflowError: Python int too large to convert to C long
    assert f"Report: {tmp_path / 'report' / 'index.html'}" in result.output
    rows = read_logs(tmp_path / "profile").table.to_pylist()
    assert [row["step"] for row in rows if row["end"] == 1767225609.0] == [1]  # the step its directory names


@pytest.mark.parametrize(("command", "planted"), [("report", "report"), ("report", "report/index.html"),
                                                  ("trace", "trace.json")])  # fmt: skip
def test_a_planted_link_in_the_log_directory_is_refused_and_what_it_points_to_untouched(
    valid, tmp_path, command, planted
):
    root, _ = valid
    logs = tmp_path / "profile"
    shutil.copytree(root, logs)
    users = tmp_path / "users"
    users.mkdir()
    (users / "index.html").write_text("mine")
    (logs / planted).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(users if planted == "report" else users / "index.html", logs / planted)
    result = CliRunner().invoke(cli, ["profile", command, str(logs)])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == (
        f"Error: {logs / planted} is a symbolic link; skip never writes through a link or over what it did not "
        "write: remove it or choose another output directory"
    )
    assert [(p.name, p.read_text()) for p in users.iterdir()] == [("index.html", "mine")]


def test_a_log_of_request_spans_alone_is_reported(tmp_path):
    log = tmp_path / "profile" / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    requests = [{"event": "request", "duration_sec": 0.5 + r, "start": T0 + r, "request_id": f"r{r}"} for r in range(3)]
    log.write_text("".join(json.dumps(span) + "\n" for span in requests))
    result = invoke("profile", "report", tmp_path / "profile")  # was: a numpy casting error, then a pyarrow one
    assert result.exit_code == 0, result.output
    assert "The slowest request of step 1, r2 on worker 0, took 2.5 s." in result.output
    assert (tmp_path / "profile" / "report" / "index.html").is_file()


HOSTILE = [
    b'{"event": "generate", "duration_sec": 1, "start": 1e400}',  # json.loads reads inf
    b'{"event": "generate", "duration_sec": NaN, "start": 1700000000}',
    b'{"event": "generate", "duration_sec": Infinity, "start": 1700000000}',
    b'{"event": "generate", "duration_sec": -3.5, "start": 1700000000}',
    b'{"event": "generate", "duration_sec": "soon", "start": 1700000000}',
    b'{"event": "generate", "duration_sec": true, "start": 1700000000}',
    b'{"event": "generate", "duration_sec": 1, "start": 1e300}',
    b'{"event": "generate", "duration_sec": 1, "start": 1700000000, "workid": 9223372036854775807, "turn": -1e30}',
    b'{"event": "generate", "duration_sec": 1, "start": 1700000000, "span_id": 99999999999999999999, "pid": []}',
    b'{"event": ["generate"], "duration_sec": {"s": 1}, "start": "yesterday", "step": {"k": null}}',
    b'{"event": "generate", "duration_sec": 1, "timestamp": "9999-12-31T23:59:59-23:59"}',
    b'{"event": "generate", "duration_sec": 1, "timestamp": 12}',
    b'{"event": "\\ud800", "duration_sec": 1, "start": 1700000000, "extra": {"\\udfff": "\\ud800"}}',
    b'{"event": "gen\xff\xfe", "duration_sec": 1, "start": 1700000000}',
    b'{"a.b": 1, "a": {"b": 2}, "event": "x", "duration_sec": 1, "start": 1700000000}',
    b'{"event": "generate", "duration_sec": 1, "start": 1700000000, "step": ' + b"9" * 5000 + b"}",
    b'{"event": "generate", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # pyarrow would segfault
    b'{"event": "generate", "extra": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b"[" * 200_000,
    b"\x00\x01\x02 not json",
    b"17",
    b"",
]


def test_no_line_kills_report_or_trace(valid, tmp_path):
    _, lines = valid
    log = tmp_path / "profile" / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(lines + b"\n".join(HOSTILE) + b'\n{"event": "generate", "duration_sec": 0.5, "sta')
    unreadable = tmp_path / "profile" / "step_1" / "worker_1.jsonl"
    unreadable.mkdir()  # a directory named like a log: not read, not fatal
    os.mkfifo(tmp_path / "profile" / "step_1" / "worker_2.jsonl")  # a named pipe: reading it would wait forever
    result = invoke("profile", "report", tmp_path / "profile", "--out", tmp_path / "report")
    assert result.exit_code == 0, result.output
    assert "unreadable lines: worker_0.jsonl" in result.output
    result = invoke("profile", "trace", tmp_path / "profile", "-o", tmp_path / "trace.json")
    assert result.exit_code == 0, result.output
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert all(0 <= e["ts"] < 10**15 and 0 <= e["dur"] < 10**15 for e in spans)


def test_bad_numbers_are_dropped_with_their_field_or_their_line(valid, tmp_path):
    _, lines = valid
    log = tmp_path / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(lines + b"\n".join(HOSTILE[:13]) + b"\n")
    logs, alone = read_logs(tmp_path), read_logs(valid[0])
    extra = logs.table.filter(_unmatched(logs.table, alone.table))
    # kept: the start past the year 5138 falls back to nothing (no timestamp); the big ids are
    # dropped; the timestamp zoned past 9999 and the numeric one are no times
    assert sorted(extra["duration"].to_pylist()) == [1.0, 1.0, 1.0]
    assert {r["workid"] for r in extra.to_pylist()} == {0}  # 2**63 - 1: the file's worker instead
    assert all(r["turn"] is None and r["span_id"] is None and r["pid"] is None for r in extra.to_pylist())
    assert logs.lines_skipped - alone.lines_skipped == 10 and logs.instants == alone.instants


def _unmatched(table, within):
    """Which rows of ``table`` have no equal in ``within`` (each row of ``within`` matches once)."""
    seen = collections.Counter(_rows(within, table.column_names))
    unmatched = []
    for row in _rows(table, table.column_names):
        unmatched.append(seen[row] == 0)
        seen[row] = max(seen[row] - 1, 0)
    return pa.array(unmatched)


# Values of every JSON type, the ones a 64-bit reader chokes on first.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**80).map(lambda v: v * (-1) ** v),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e12, max_value=1e12),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "nan", "Infinity", "1e400", "2026-01-01T00:00:00", "9999-12-31T23:59:59-23:59"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from(
    ["timestamp", "event", "duration_sec", "workid", "worker", "step", "phase", "start", "pid", "span_id",
     "parent_id", "extra", "request_id", "turn", "offset", "tokens_out", "turns", "tool", "file", "end", "extra.turn"]
) | st.text(max_size=6)  # fmt: skip
OBJECTS = st.dictionaries(KEYS, VALUES, max_size=6).map(lambda obj: json.dumps(obj).encode())
NUMBERS = SCALARS | st.floats(0, 5) | st.floats(T0, T0 + 60) | st.integers(-3, 10)
ATTRIBUTES = st.fixed_dictionaries({}, optional={k: NUMBERS | VALUES for k in ("request_id", "tokens_out", "turns")})
SPANS = st.fixed_dictionaries(  # near spans, which reach the analyses
    {"event": st.sampled_from(["generate", "request", "turn", "tool_call", "rollout", "barrier_wait"]) | SCALARS,
     "duration_sec": NUMBERS, "start": NUMBERS},
    optional={key: NUMBERS | VALUES for key in ("step", "workid", "turn", "span_id", "parent_id", "pid", "timestamp")}
    | {"extra": ATTRIBUTES},
).map(lambda obj: json.dumps(obj).encode())  # fmt: skip
NESTED = st.integers(1, 300).map(lambda depth: b'{"extra": ' + b"[" * depth + b"]" * depth + b"}")
LINES = st.one_of(
    SPANS,
    OBJECTS,
    OBJECTS.map(lambda line: line.replace(b'"', b"", 1)),  # almost JSON
    NESTED,
    st.binary(max_size=40).map(lambda raw: raw.replace(b"\n", b"")),
)


def test_a_list_of_nulls_keeps_its_line(tmp_path):
    """pyarrow 26's JSON reader builds ``[null, null]`` one value short, and any read of the array
    crashed the report; the file now goes the slow way and the span is read."""
    log = tmp_path / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    span = {"event": "generate", "duration_sec": 0.5, "start": 1700000000, "extra": {"tool_calls": [None, None]}}
    log.write_text(json.dumps(span) + "\n")
    rows = read_logs(tmp_path).table.to_pylist()
    assert [(row["event"], row["tool_calls"]) for row in rows] == [("generate", [None, None])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(hostile=[(0, b'{"": [null, null]}')], cut=0)  # found by the search: a crash before the fix
@given(hostile=st.lists(st.tuples(st.integers(0, 40), LINES), min_size=1, max_size=6), cut=st.integers(0, 30))
def test_hostile_lines_neither_crash_nor_change_the_valid_ones(valid, tmp_path_factory, hostile, cut):
    root, lines = valid
    mixed = lines.splitlines(keepends=True)
    for at, line in sorted(hostile, key=lambda pair: -pair[0]):
        mixed.insert(min(at, len(mixed)), line + b"\n")
    truncated = hostile[-1][1][:cut] if cut else b""
    directory = tmp_path_factory.mktemp("mixed")
    log = directory / "step_1" / "worker_0.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"".join(mixed) + truncated)
    shutil.copytree(root / "step_2", directory / "step_2")

    logs, alone = read_logs(directory), read_logs(root)
    assert not any(_unmatched(alone.table, logs.table).to_pylist()), "a valid line's row changed or vanished"
    result = analysis.analyze(logs)
    analysis.findings(result)
    write_trace(logs, directory / "trace.json")


def _rows(table, names):
    """Rows as tuples of the named columns; an attribute as a number where it reads as one, so a
    column made text by one odd value (``tokens_out: "x"``) still compares with its numbers."""
    columns = [table[name].to_pylist() if name in table.column_names else [None] * table.num_rows for name in names]
    numeric = [name not in CORE.names for name in names]
    rows = zip(*columns, strict=True)
    return [tuple(_number(v) if n else v for v, n in zip(row, numeric, strict=True)) for row in rows]


def _number(value):
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            return value
        return None if math.isnan(number) else number
    return value


def test_a_planted_link_where_a_worker_logs_stops_profiling_with_a_warning_and_is_not_followed(tmp_path):
    from skip_plugin_profiling.recorder import ProfilingWarning

    users = tmp_path / "users.txt"
    users.write_text("mine")
    (tmp_path / "profile" / "step_1").mkdir(parents=True)
    os.symlink(users, tmp_path / "profile" / "step_1" / "worker_0.jsonl")
    recorder = Recorder(tmp_path / "profile", worker=0, flush_interval_s=3600)
    with pytest.warns(ProfilingWarning, match="is a symbolic link; skip never writes through a link"):
        emit(recorder, "generate", None, 0.0, 1.0, step=1)
        recorder.close()
    assert users.read_text() == "mine"


def test_a_log_directory_nested_past_the_recursion_limit_is_read(valid, tmp_path):
    from skip_core.files import delete_tree
    from skiptests import deep_tree

    root, _ = valid
    shutil.copytree(root, tmp_path / "profile")
    deep = deep_tree(tmp_path / "profile" / "step_1" / "nested")  # a step directory is read whole
    try:
        assert len(read_logs(tmp_path / "profile")) == len(read_logs(root))  # Path.rglob: a RecursionError
    finally:  # pytest's clean-up of old temporary directories recurses
        delete_tree(deep)
