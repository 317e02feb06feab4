"""Nothing of the user's is deleted, nothing someone else wrote is replaced, and a live writer's
namespace is not written by another process: through the real store, manager and ``skip cache``.

A user's file inside an entry (even under one of skip's names, ``data.json/``), an entry of
another format version, another process's dumps: each is left where it is and named.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
from click.testing import CliRunner
from skip_core import SkipManager
from skip_core.cli import cli
from skip_core.entries import remove
from skip_core.files import LOCK
from skip_core.store import CacheStore, CacheWarning
from skiptests import NS, ROOT, make_batch, make_prompts, run_config


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def store(tmp_path):
    store = CacheStore(tmp_path / "cache", NS, role="rollout")
    for step in (1, 2):
        store.save(step, make_batch(seed=step))
    return store


def test_a_users_file_inside_data_json_survives_a_regeneration_and_a_prune(store, tmp_path):
    entry = store.path(1)
    os.unlink(entry / "data.json")
    (entry / "data.json").mkdir()
    (entry / "data.json" / "notes.txt").write_text("mine")

    with pytest.raises(FileExistsError, match=r"holds data\.json/, which skip did not write; left as it is"):
        store.save(1, make_batch(seed=3))
    dry = invoke("cache", "prune", "--dry-run", tmp_path / "cache")
    assert f"left {entry} as it is: holds data.json/, which skip did not write" in dry.output
    assert "0 directories to remove" in dry.output
    assert invoke("cache", "prune", tmp_path / "cache").exit_code == 0
    assert (entry / "data.json" / "notes.txt").read_text() == "mine"


def test_regenerating_a_corrupt_entry_removes_only_skips_files(store):
    entry = store.path(2)
    (entry / "meta.json").write_text("{not json")  # corrupt: replaced by the next dump
    store.save(2, make_batch(seed=4))
    assert store.load(store.entry(2)).equals(make_batch(seed=4))


def test_remove_deletes_skips_files_and_leaves_the_rest_with_their_directory(store):
    entry = store.path(1)
    (entry / "later.txt").write_text("someone's")
    assert remove(entry) == ["later.txt"]
    assert sorted(os.listdir(entry)) == ["later.txt"]
    assert remove(store.path(2)) == [] and not os.path.lexists(store.path(2))


def test_an_entry_of_another_format_version_is_neither_overwritten_nor_pruned(store, tmp_path):
    entry = store.path(1)
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "version": 2}))
    before = {name: (entry / name).read_bytes() for name in os.listdir(entry)}

    with pytest.raises(FileExistsError, match=r"version 2, which this skip .* neither reads nor replaces; left as"):
        store.save(1, make_batch(seed=9))
    listing = invoke("cache", "ls", tmp_path / "cache").output
    assert "foreign: written as format 'skip-cache' version 2" in listing
    result = invoke("cache", "prune", tmp_path / "cache")
    assert f"left {entry} as it is: written as format 'skip-cache' version 2" in result.output
    assert {name: (entry / name).read_bytes() for name in os.listdir(entry)} == before


def test_a_run_dumping_over_a_foreign_entry_warns_generates_and_leaves_it(tmp_path, generator):
    cache = tmp_path / "cache"
    CacheStore(cache, NS, role="rollout").save(1, make_batch())
    entry = CacheStore(cache, NS, role="rollout").path(1)
    (entry / "gen_batch.dp").write_bytes(b"verl's")
    SkipManager.init(run_config(cache, steps=[1]))
    SkipManager.set_step(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        generator.generate_sequences(make_prompts())
        SkipManager.flush()
    messages = [str(w.message) for w in said if issubclass(w.category, CacheWarning)]
    assert any("ignoring cache entry" in m and "holds gen_batch.dp" in m for m in messages), messages
    assert any("dump failed" in m and "left as it is" in m for m in messages), messages
    assert generator.calls == 1 and (entry / "gen_batch.dp").read_bytes() == b"verl's"


_WRITER = """
import json, sys, warnings
sys.path[:0] = [{shared!r}]
from skip_core import SkipManager
from skiptests import Generator, make_prompts, run_config
SkipManager.init(run_config({cache!r}, steps=[7]))
SkipManager.set_step(7)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    Generator().generate_sequences(make_prompts())
    SkipManager.flush()
print(json.dumps([str(w.message) for w in said]))
"""


def test_a_second_process_dumping_into_a_held_namespace_dumps_nothing_and_says_who_holds_it(tmp_path, generator):
    cache = tmp_path / "cache"
    SkipManager.init(run_config(cache, steps=[1]))
    SkipManager.set_step(1)
    generator.generate_sequences(make_prompts())  # this process now writes the namespace
    SkipManager.flush()
    namespace = SkipManager.stores()["rollout"].directory
    assert (namespace / LOCK).is_file()

    code = _WRITER.format(shared=str(ROOT / "tests"), cache=str(cache))
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (said,) = json.loads(other.stdout)
    assert said.startswith(f"skip.rollout: nothing is dumped: {namespace} is in use by pid {os.getpid()} on ")
    assert "(dumping skip.rollout)" in said
    assert sorted(os.listdir(namespace)) == [LOCK, "1"]

    SkipManager.reset()  # this run is over: its lock goes, and the next process writes
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == []
    assert sorted(os.listdir(namespace)) == ["1", "7"]


def test_a_trainer_holds_its_namespaces_before_any_work(tmp_path):
    SkipManager.init(run_config(tmp_path / "cache", steps=[1]))
    SkipManager.hold("skip run demo")
    store = SkipManager.stores()["rollout"]
    assert "(skip run demo)" in (store.directory / LOCK).read_text()
    SkipManager.reset()
    assert not os.path.lexists(store.directory / LOCK)
