"""Long work's progress: plain lines in a pipe (with the same lines in a log), none with SKIP_QUIET=1."""

import skip_core.progress
from skip_core.progress import progress


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
