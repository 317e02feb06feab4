"""Writes below an output root never follow a link, and a directory in use stops a second writer.

``skip_core.writing`` is the one way a command writes below its output directory: a link
planted at the destination or at any directory between it and the root is refused in one line,
and nothing outside the root changes. ``files.exclusive`` is the lock a writer holds.
"""

import os
import subprocess
import sys

import pytest
from skip_core import files, writing
from skip_core.escaping import printable
from skiptests import assert_umask_modes


def test_a_file_is_written_atomically_below_new_directories_with_the_umask_modes(tmp_path, umask):
    path = writing.write_text(tmp_path / "out", "report/figures/index.html", "<html>")
    assert path.read_text() == "<html>"
    assert sorted(p.name for p in (tmp_path / "out" / "report" / "figures").iterdir()) == ["index.html"]
    assert_umask_modes(tmp_path / "out", umask)


@pytest.mark.parametrize("planted", ["report", "report/index.html"])
def test_a_link_on_the_way_or_at_the_destination_is_refused_and_its_target_untouched(tmp_path, planted):
    users = tmp_path / "users"
    users.mkdir()
    (users / "index.html").write_text("mine")
    out = tmp_path / "out"
    (out / "report").mkdir(parents=True) if "/" in planted else out.mkdir()
    os.symlink(users if planted == "report" else users / "index.html", out / planted)
    with pytest.raises(writing.UnsafeDestination, match=f"{out / planted} is a symbolic link; skip never writes"):
        writing.write_text(out, "report/index.html", "trace")
    assert (users / "index.html").read_text() == "mine"
    assert sorted(p.name for p in users.iterdir()) == ["index.html"]
    assert os.path.islink(out / planted)


def test_a_dangling_link_is_refused_and_nothing_is_created_where_it_points(tmp_path):
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "trace.json")
    with pytest.raises(writing.UnsafeDestination):
        writing.write_text(tmp_path / "out", "trace.json", "{}")
    assert not os.path.lexists(tmp_path / "elsewhere")


def test_a_directory_at_the_files_name_is_refused_not_replaced(tmp_path):
    (tmp_path / "out" / "trace.json").mkdir(parents=True)
    (tmp_path / "out" / "trace.json" / "user.txt").write_text("mine")
    with pytest.raises(writing.UnsafeDestination, match="is a directory"):
        writing.write_text(tmp_path / "out", "trace.json", "{}")
    assert (tmp_path / "out" / "trace.json" / "user.txt").read_text() == "mine"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    writing.write_text(tmp_path, "metrics.jsonl", "old")
    with pytest.raises(RuntimeError), writing.opened(tmp_path, "metrics.jsonl", "w") as out:
        out.write("half")
        raise RuntimeError("killed mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == "old"


@pytest.mark.parametrize("relative", ["../escape.txt", "/etc/passwd", "a/../../b"])
def test_paths_that_leave_the_root_are_refused(tmp_path, relative):
    with pytest.raises(ValueError, match="not a path inside the output directory"):
        writing.write_text(tmp_path, relative, "x")


def test_the_root_itself_may_be_a_link_the_user_chose(tmp_path):
    (tmp_path / "big").mkdir()
    os.symlink(tmp_path / "big", tmp_path / "runs")
    writing.write_text(tmp_path / "runs", "a/b.txt", "x")
    assert (tmp_path / "big" / "a" / "b.txt").read_text() == "x"


_LOCK = "import sys; from pathlib import Path; from skip_core import files\nwith files.exclusive(Path(sys.argv[1]), "
_HOLD = _LOCK + "'skip run demo'):\n    print('held', flush=True); sys.stdin.read()"
_TAKE = _LOCK + "'x'): print('taken')"


def _hold(directory):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def _take(directory):
    return subprocess.run([sys.executable, "-c", _TAKE, str(directory)], capture_output=True, text=True)


def test_a_second_process_on_a_held_directory_stops_naming_the_holder_until_it_ends(tmp_path):
    holder = _hold(tmp_path)
    try:
        second = _take(tmp_path)
        assert second.returncode == 1
        assert f"DirectoryInUse: {tmp_path} is in use by pid {holder.pid} on " in second.stderr
        assert "(skip run demo); wait for it to end, or give this run another directory" in second.stderr
    finally:
        holder.communicate("")
    assert _take(tmp_path).stdout == "taken\n"


def test_a_killed_holder_leaves_the_directory_free(tmp_path):
    holder = _hold(tmp_path)
    holder.kill()
    holder.wait()
    assert _take(tmp_path).stdout == "taken\n"


def test_one_process_may_take_its_own_lock_again(tmp_path):
    with files.exclusive(tmp_path, "run"), files.exclusive(tmp_path, "its cache"):
        pass
    with files.exclusive(tmp_path, "next run"):
        assert "(next run)" in (tmp_path / files.LOCK).read_text()


def test_a_planted_lock_link_or_pipe_is_refused(tmp_path):
    os.symlink(tmp_path / "elsewhere", tmp_path / files.LOCK)
    with pytest.raises(files.DirectoryInUse, match="is a symbolic link"), files.exclusive(tmp_path, "run"):
        pass
    assert not os.path.lexists(tmp_path / "elsewhere")
    os.unlink(tmp_path / files.LOCK)
    os.mkfifo(tmp_path / files.LOCK)
    with pytest.raises(files.DirectoryInUse, match="is not a regular file"), files.exclusive(tmp_path, "run"):
        pass


def test_a_file_where_a_directory_should_be_is_named_as_a_file(tmp_path):
    (tmp_path / "report").write_text("mine")
    with pytest.raises(writing.UnsafeDestination, match=r"report is a file; skip never writes"):
        writing.write_text(tmp_path, "report/index.html", "x")
    assert (tmp_path / "report").read_text() == "mine"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("run\x1b[2J", "run\\x1b[2J"),
        ("\x1b]0;pwned\x07title", "\\x1b]0;pwned\\x07title"),
        ("a\nb\rc\x00", "a\\x0ab\\x0dc\\x00"),
        ("exe.\u202etxt", "exe.\\u202etxt"),
        ("\x9b31m", "\\x9b31m"),
        ("plain ñame / 名前", "plain ñame / 名前"),
    ],
)
def test_printable_escapes_every_control_and_reordering_character(text, shown):
    assert printable(text) == shown


def test_the_console_escapes_what_it_renders_and_keeps_its_own_layout(capsys):
    from rich.table import Table
    from rich.text import Text
    from skip_core.console import console

    table = Table()
    table.add_column("entry")
    table.add_row(Text("step\x1b[8mhidden"))
    console.print("cleared\x1b[2J\nnext line", markup=False)
    console.print(table)
    out = capsys.readouterr().out
    assert "\x1b" not in out.replace("\\x1b", "")
    assert "cleared\\x1b[2J\nnext line" in out and "step\\x1b[8mhidden" in out
