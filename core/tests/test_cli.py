import json
import os
import re
import subprocess
import sys
import time

import pytest
import skip_core.progress
from click.testing import CliRunner
from skip_core.cli import cli
from skip_core.store import CacheStore
from skiptests import NS, corrupt_one_byte, make_batch


@pytest.fixture
def cache(tmp_path):
    store = CacheStore(tmp_path, NS, role="rollout")
    for step in (1, 2, 3):
        store.save(step, make_batch(seed=step))
    return store


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_plugins_lists_distributions_and_what_each_provides_commands_and_sections_included():
    result = invoke("plugins")
    assert result.exit_code == 0
    rows: dict[str, str] = {}
    name = ""
    for line in result.output.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 5:  # a row, or the next line of a row whose cells wrap
            name = cells[0] or name
            rows[name] = rows.get(name, "") + " " + " ".join(cells)
    assert "role async_rollout" in rows["skip-plugin-async-rollout"]
    assert "command profile" in rows["skip-plugin-profiling"] and "section profiling" in rows["skip-plugin-profiling"]
    assert "command profile report" not in result.output  # a group a plugin added is listed once
    assert "command cache import-verl" in rows["skip-plugin-verl"]
    assert "command run" in rows["skip-plugin-trainer"] and "section rollout" in rows["skip-plugin-trainer"]


def test_ls_lists_every_entry(cache, tmp_path):
    result = invoke("cache", "ls", tmp_path)
    assert result.exit_code == 0
    assert result.output.count("ok (sizes)") == 3
    assert "exp_proj/GBS4_N1_in8_out16/2" in result.output


def test_verify_passes_a_clean_cache_and_fails_a_corrupt_one(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)  # so that a quick verify shows its progress too
    clean = invoke("cache", "verify", tmp_path)
    assert clean.exit_code == 0
    assert "verifying 3/3 entries" in clean.output  # its progress, in a pipe
    corrupt_one_byte(cache.path(2) / "tensors.safetensors")
    assert invoke("cache", "ls", tmp_path).output.count("ok (sizes)") == 3  # same size: only a hash shows it
    result = invoke("cache", "verify", tmp_path)
    assert result.exit_code == 1
    assert "does not match its recorded hash" in result.output and "1 corrupt entry" in result.output


def test_names_from_disk_are_never_read_as_markup(cache, tmp_path):
    meta = json.loads((cache.path(1) / "meta.json").read_text())
    meta["role"] = "[/x][bold]evil"
    (cache.path(1) / "meta.json").write_text(json.dumps(meta))
    meta = json.loads((cache.path(2) / "meta.json").read_text())
    meta["version"] = "[/oops]"
    (cache.path(2) / "meta.json").write_text(json.dumps(meta))
    result = invoke("cache", "verify", tmp_path)
    assert result.exit_code == 1
    assert "[/x][bold]evil" in result.output and "'[/oops]'" in result.output
    assert invoke("cache", "prune", tmp_path, "--dry-run").exit_code == 0


@pytest.mark.parametrize("command", ["ls", "verify", "prune"])
def test_terminal_escapes_from_disk_never_reach_the_terminal(cache, tmp_path, command):
    """A clear-screen, a window title and hidden text in names and meta.json: shown escaped."""
    meta = json.loads((cache.path(1) / "meta.json").read_text())
    meta["role"] = "\x1b[2Jrollout\x1b]0;pwned\x07"
    (cache.path(1) / "meta.json").write_text(json.dumps(meta))
    (cache.path(2) / "data.json").rename(cache.path(2) / "\x1b[8mhidden")  # a foreign file name
    os.rename(tmp_path / "exp_proj", tmp_path / "exp\x1b[31mproj")
    result = invoke("cache", command, tmp_path)
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b[8mhidden" in result.output  # named, escaped


def test_a_one_line_error_and_a_warning_are_escaped_too(tmp_path):
    from skip_core.cli import _one_line_warning

    assert _one_line_warning("step\x1b[2J\nnext", UserWarning, "f.py", 1) == "UserWarning: step\\x1b[2J next\n"
    missing = tmp_path / "run\x1b]0;title\x07"
    result = CliRunner().invoke(cli, ["cache", "ls", str(missing)])
    assert result.exit_code == 2 and "\x1b" not in result.output


def table_rows(output: str) -> list[list[str]]:
    """The body rows of a table the CLI printed, each as its cells."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines() if line.startswith("│")]


def test_verify_accepts_a_single_step_directory(cache):
    corrupt_one_byte(cache.path(2) / "tensors.safetensors")  # another entry: not this one's business
    result = invoke("cache", "verify", cache.path(1))
    assert result.exit_code == 0
    # role, step, samples, MB, status (hashes checked), entry: the directory itself
    assert table_rows(result.output) == [["rollout", "1", "4", "0.0", "ok", "."]]
    assert "all 1 entries verified" in result.output

    corrupt_one_byte(cache.path(1) / "tensors.safetensors")  # the same size: only its hash shows it
    result = invoke("cache", "verify", cache.path(1))
    assert result.exit_code == 1 and "1 corrupt entry" in result.output
    first = table_rows(result.output)[0]
    assert (first[1], first[-1]) == ("1", ".")
    assert "tensors.safetensors does not match its recorded hash" in result.output


def test_prune_removes_corrupt_entries_and_old_leftovers_only(cache, tmp_path):
    corrupt_one_byte(cache.path(3) / "data.json")
    old, fresh = cache.directory / ".tmp-4-old", cache.directory / ".tmp-5-fresh"
    old.mkdir()
    fresh.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))

    dry = invoke("cache", "prune", tmp_path, "--dry-run")
    assert "2 directories to remove" in dry.output and cache.path(3).exists()

    result = invoke("cache", "prune", tmp_path)
    assert result.exit_code == 0
    assert sorted(p.name for p in cache.directory.iterdir()) == [".tmp-5-fresh", "1", "2"]
    assert invoke("cache", "verify", tmp_path).exit_code == 0


def test_a_long_path_stays_on_one_line_in_a_pipe(tmp_path):
    """Pipes and CI logs are no terminal: a line naming a path is never folded (a grep finds it)."""
    deep = tmp_path / ("d" * 100) / ("e" * 100)
    store = CacheStore(deep, NS, role="rollout")
    store.save(1, make_batch(seed=1))
    corrupt_one_byte(store.path(1) / "data.json")

    result = invoke("cache", "prune", deep, "--dry-run")

    assert len(str(store.path(1))) > 250
    (line,) = [line for line in result.output.splitlines() if line.startswith("would remove")]
    assert f"would remove {store.path(1)} (corrupt" in line


def test_prune_keeps_a_directory_holding_files_skip_did_not_write(cache, tmp_path):
    verl_dump = cache.path(4)
    verl_dump.mkdir()
    (verl_dump / "gen_batch.dp").write_bytes(b"verl's rollout")
    (verl_dump / "meta.json").write_text('{"global_steps": 4}')
    corrupt_one_byte(cache.path(3) / "data.json")

    assert "foreign: holds gen_batch.dp, which skip did not write" in invoke("cache", "ls", tmp_path).output
    result = invoke("cache", "prune", tmp_path)

    assert f"left {verl_dump} as it is: holds gen_batch.dp, which skip did not write" in result.output
    assert "1 directory removed" in result.output
    assert sorted(p.name for p in cache.directory.iterdir()) == ["1", "2", "4"]
    assert (verl_dump / "gen_batch.dp").read_bytes() == b"verl's rollout"


def test_a_command_of_an_uninstalled_plugin_exits_1_saying_which_distribution_brings_it():
    env = {**os.environ, "SKIP_PLUGINS": ""}
    code = "from skip_core.cli import cli; cli()"
    for args, hint in (
        (
            ["run"],
            r"`skip run` comes with a plugin that is not installed: install skip-plugin-trainer .*\./plugins/trainer",
        ),
        (["cache", "import-verl", "x", "y"], r"install skip-plugin-verl .*pip install \./plugins/verl"),
    ):
        done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
        assert done.returncode == 1 and re.search(hint, done.stderr), done.stderr  # an error, as every other
