"""Long work's progress: plain lines in a pipe (with the same lines in a log), none with SKIP_QUIET=1."""

import time

import pytest
import skip_core.progress
from skip_core.progress import progress, waiting


def test_a_pipe_gets_a_line_every_period_and_one_at_the_end_and_the_log_the_same(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)
    log = tmp_path / "work.log"
    with progress(3, "building", unit="steps", log=log) as advance:
        advance(note="loss 1.500")
        advance(2)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in printed] == ["building 1/3 steps"] + ["building 3/3 steps"] * 2
    assert printed[0].startswith("building 1/3 steps, loss 1.500, ") and "s left" in printed[0]
    assert "s left" not in printed[-1]
    assert [line.split(" ", 2)[2] for line in log.read_text().splitlines()] == printed


def test_skip_quiet_shows_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)
    monkeypatch.setenv("SKIP_QUIET", "1")
    with progress(2, "building", log=tmp_path / "work.log") as advance:
        advance()
        advance()
    assert capsys.readouterr().out == "" and not (tmp_path / "work.log").exists()


def test_a_wait_of_unknown_length_speaks_from_its_own_thread_while_the_caller_blocks(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.01)
    log = tmp_path / "work.log"
    with waiting("starting the engine", log=log):
        deadline = time.monotonic() + 60
        while len(capsys.readouterr().out.splitlines()) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # blocked, as a model's load blocks: only the ticker can print
    with waiting("starting the engine"):
        pass
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("starting the engine, ") and last.endswith(" s elapsed") and "/" not in last
    assert log.read_text().count("starting the engine, ") >= 2  # a tick and the closing line


def test_skip_quiet_silences_a_wait_too(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)
    monkeypatch.setenv("SKIP_QUIET", "1")
    with waiting("starting the engine", log=tmp_path / "work.log"):
        pass
    assert capsys.readouterr().out == "" and not (tmp_path / "work.log").exists()


def test_work_done_within_the_period_adds_no_line(capsys, tmp_path):
    with progress(2, "saving the checkpoint", unit="ranks", log=tmp_path / "work.log") as advance:
        advance(2)
    with waiting("starting the engine"):
        pass
    assert capsys.readouterr().out == "" and not (tmp_path / "work.log").exists()


def test_a_log_that_is_a_link_is_refused_with_a_warning_and_the_work_goes_on(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    (tmp_path / "work.log").symlink_to(target)
    refused = pytest.warns(RuntimeWarning, match="cannot append to the progress log")
    with refused, progress(2, "building", log=tmp_path / "work.log") as advance:
        advance(2)
    assert target.read_text() == "" and capsys.readouterr().out.count("building 2/2 steps") == 2
