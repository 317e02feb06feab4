import itertools
import json
import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skip_core import Batch, ConfigError, SkipManager
from skip_core.config import Namespace
from skip_core.encoding import fingerprint
from skip_core.entries import file_digest, leftovers, verify
from skip_core.store import CacheStore, CacheWarning, safe_name
from skip_core.writing import UnsafeDestination
from skiptests import NS, Generator, corrupt_one_byte, make_batch, make_prompts, run_config


@pytest.fixture
def store(tmp_path) -> CacheStore:
    return CacheStore(tmp_path, NS, role="rollout")


def test_round_trip_keeps_every_part(store):
    batch = make_batch()
    path = store.save(3, batch, fingerprint="abc")
    assert path == store.directory / "3"
    entry = store.entry(3)
    assert entry.fingerprint == "abc"
    assert store.load(entry).equals(batch)
    assert sorted(p.name for p in path.iterdir()) == ["data.json", "meta.json", "tensors.safetensors"]


def test_layout_uses_verl_names(store, tmp_path):
    store.save(1, make_batch())
    assert (tmp_path / "exp_proj" / "GBS4_N1_in8_out16" / "1" / "meta.json").is_file()


def test_views_sharing_storage_are_stored(store):
    full = torch.arange(64).view(4, 16)
    batch = Batch.from_dict({"input_ids": full, "responses": full[:, 8:], "prompts": full[:, :8], "t": full.t()[:4]})
    store.save(1, batch)
    assert store.load(store.entry(1)).equals(batch)


def test_save_replaces_an_existing_entry(store):
    store.save(1, make_batch(seed=1))
    store.save(1, make_batch(seed=2))
    assert store.load(store.entry(1)).equals(make_batch(seed=2))
    assert [p.name for p in store.directory.iterdir()] == ["1"]


def test_a_directory_holding_files_skip_did_not_write_is_never_replaced(store):
    """verl writes its dumps where skip writes role ``rollout``: replacing one would delete it."""
    verl_dump = store.path(1)
    verl_dump.mkdir(parents=True)
    (verl_dump / "gen_batch.dp").write_bytes(b"verl's rollout")
    (verl_dump / "meta.json").write_text('{"global_steps": 1}')

    with pytest.raises(FileExistsError, match=r"holds gen_batch.dp, which skip did not write; left as it is"):
        store.save(1, make_batch())

    assert (verl_dump / "gen_batch.dp").read_bytes() == b"verl's rollout"
    assert sorted(p.name for p in store.directory.iterdir()) == ["1"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: corrupt_one_byte(p / "tensors.safetensors"), "does not match its recorded hash"),
        (lambda p: corrupt_one_byte(p / "data.json"), "does not match its recorded hash"),
        (lambda p: os.truncate(p / "tensors.safetensors", 100), "has 100 bytes"),
        (lambda p: (p / "data.json").unlink(), "cannot read data.json"),
        (lambda p: (p / "meta.json").unlink(), "incomplete"),
        (lambda p: os.truncate(p / "meta.json", 40), "not valid JSON"),
        (lambda p: (p / "meta.json").write_text("[]"), "not an object"),
    ],
)
def test_damaged_entries_warn_name_the_path_and_miss(store, damage, reason):
    store.save(2, make_batch())
    damage(store.path(2))
    with pytest.warns(CacheWarning, match=reason) as record:
        assert store.entry(2) is None
    assert str(store.path(2)) in str(record[0].message)


def rewrite_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"role": "async_rollout"}, "written for role 'async_rollout'"),
        ({"namespace": {**vars(NS), "n": 8}}, "written by another run"),
        ({"step": 5}, "records step 5"),
        ({"version": 99}, r"version 99, which this skip .* neither reads nor replaces"),
        ({"files": {"../../etc/passwd": {"bytes": 1, "xxh3_128": "0"}}}, "meta.json lists files"),
    ],
)
def test_foreign_entries_are_ignored(store, changes, reason):
    store.save(2, make_batch())
    rewrite_meta(store.path(2), **changes)
    with pytest.warns(CacheWarning, match=reason):
        assert store.entry(2) is None


class Exploit:
    """A pickle that creates a marker file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_never_executes(tmp_path, store):
    """Even a self-consistent entry (hashes recomputed by the attacker) cannot run code."""
    marker = tmp_path / "pwned"
    store.save(1, make_batch())
    entry = store.path(1)
    payload = pickle.dumps(Exploit(marker))
    for name in ("tensors.safetensors", "data.json"):
        (entry / name).write_bytes(payload)
    meta = json.loads((entry / "meta.json").read_text())
    for name in meta["files"]:
        meta["files"][name] = {"bytes": len(payload), "xxh3_128": file_digest(entry / name)}
    (entry / "meta.json").write_text(json.dumps(meta))

    generator = Generator()
    SkipManager.init(run_config(tmp_path, steps=[1]))  # the namespace of NS
    SkipManager.set_step(1)
    with pytest.warns(CacheWarning, match="running it instead"):
        out = generator.generate_sequences(make_prompts())
    SkipManager.flush()
    assert generator.calls == 1 and len(out) == 4
    assert not marker.exists()


@given(st.text(max_size=40), st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_names_from_config_stay_inside_the_dump_dir(experiment, project):
    root = Path("/srv/cache")
    store = CacheStore(root, Namespace(experiment, project), role="rollout")
    component = store.directory.parent.name
    assert store.directory.parent.parent == root
    assert "/" not in component and "\x00" not in component and not component.startswith(".")


@pytest.mark.parametrize("name", ["../../x", "..", "/etc", "a/../../b", ".hidden", "x\x00y", "~root"])
def test_traversal_names_write_under_the_dump_dir(tmp_path, name):
    root = tmp_path / "dump"
    store = CacheStore(root, Namespace(name, name), role="rollout")
    store.save(1, make_batch())
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.resolve().is_relative_to(root.resolve()) for p in written)
    assert store.directory.parent.name == safe_name(f"{name}_{name}")


def test_a_symlink_out_of_the_dump_dir_is_refused(tmp_path):
    root, outside = tmp_path / "dump", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "exp_proj").symlink_to(outside, target_is_directory=True)
    store = CacheStore(root, NS, role="rollout")
    with pytest.raises(UnsafeDestination, match="exp_proj is a symbolic link; skip never writes through a link"):
        store.save(1, make_batch())
    assert list(outside.rglob("*")) == []
    with pytest.raises(ConfigError, match=r"skip\.rollout\.dump_dir: cannot write"):
        SkipManager.init(run_config(root))


def test_unwritable_dump_dir_fails_at_init(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"^skip.rollout.dump_dir: cannot write to .*file"):
        SkipManager.init(run_config(blocker / "cache"))


def test_repeat_order_skips_invalid_candidates(store):
    for step in (1, 2, 6):
        store.save(step, make_batch(seed=step))
    corrupt_one_byte(store.path(2) / "tensors.safetensors")
    with pytest.warns(CacheWarning):
        assert store.nearest(4).step == 1
    assert store.nearest(6).step == 6
    assert store.nearest(0).step == 1


def _dump_forever(root: str, step: int, seeds: list[int], ready) -> None:
    store = CacheStore(root, NS, role="rollout")
    batches = [make_batch(n=64, seed=s, width=4096) for s in seeds]
    ready.set()
    while True:
        for batch in batches:
            store.save(step, batch, fingerprint=fingerprint(batch))


def _save_stopping_at(root: str, batches: list[Batch], point: int, conn) -> None:
    """Save ``batches`` in turn as step 1, stopping before the ``point``-th durable file operation
    (an fsync or a rename: a disk slower than any timing could make it) to be killed there."""
    operations = 0

    def stopping(real):
        def operation(*args, **kwargs):
            nonlocal operations
            operations += 1
            if operations == point:
                conn.send("stopped")
                threading.Event().wait()
            return real(*args, **kwargs)

        return operation

    os.fsync, os.rename, os.replace = stopping(os.fsync), stopping(os.rename), stopping(os.replace)
    store = CacheStore(root, NS, role="rollout")
    for batch in batches:
        store.save(1, batch, fingerprint=fingerprint(batch))
    conn.send("saved")


def _entry_after_sigkill(store: CacheStore, expected: list[Batch]) -> int | None:
    """Which of ``expected`` the entry of step 1 loads as, ``None`` for no entry; anything else fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # a partial entry would warn and miss
        entry = store.entry(1)
    if entry is None:
        return None
    loaded = store.load(entry)
    (index,) = [i for i, batch in enumerate(expected) if loaded.equals(batch)]
    return index


@pytest.mark.loaded
def test_sigkill_at_every_durable_step_of_a_dump_leaves_the_old_entry_the_new_one_or_none(tmp_path):
    """A first dump and then its replacement, killed before each fsync and rename in turn: the
    entry is always absent or complete, the first dump's until the replacement lands, never back."""
    ctx = multiprocessing.get_context("fork")
    expected = [make_batch(n=8, seed=s, width=64) for s in (1, 2)]
    outcomes, left_over = [], []
    for point in itertools.count(1):
        root = tmp_path / str(point)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_save_stopping_at, args=(str(root), expected, point, child))
        proc.start()
        assert parent.poll(60), "the dumping process neither stopped nor finished"
        message = parent.recv()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        if message == "saved":
            break
        outcomes.append(_entry_after_sigkill(CacheStore(root, NS, role="rollout"), expected))
        left_over.append(bool(list(leftovers(root))))
    assert point > 8  # every fsync and rename of two dumps
    assert set(outcomes) == {None, 0, 1}
    first, last = outcomes.index(0), len(outcomes) - 1 - outcomes[::-1].index(0)
    assert set(outcomes[:first]) == {None} and 1 not in outcomes[:last]  # never back to the first dump
    assert outcomes[-1] == 1 and any(left_over)


@pytest.mark.loaded
def test_sigkill_at_a_random_instant_never_leaves_a_loadable_partial_entry(tmp_path):
    """Kills wherever they land, mid-write included; which instants they hit does not matter."""
    ctx = multiprocessing.get_context("fork")
    seeds = [1, 2]
    expected = [make_batch(n=64, seed=s, width=4096) for s in seeds]
    rng = random.Random(0)
    store = CacheStore(tmp_path, NS, role="rollout")
    for trial in range(12):
        ready = ctx.Event()
        proc = ctx.Process(target=_dump_forever, args=(str(tmp_path), 1, seeds, ready))
        proc.start()
        assert ready.wait(60)
        time.sleep(rng.uniform(0, 0.25) if trial % 3 else rng.uniform(0, 0.01))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        _entry_after_sigkill(store, expected)


def _dump_n_times(root: str, seed: int, start) -> None:
    store = CacheStore(root, NS, role="rollout")
    batch = make_batch(n=32, seed=seed, width=2048)
    start.wait()
    for _ in range(5):
        store.save(7, batch)


@pytest.mark.loaded
def test_concurrent_dumps_from_processes_end_with_one_complete_entry(tmp_path):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_dump_n_times, args=(str(tmp_path), seed, start)) for seed in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = CacheStore(tmp_path, NS, role="rollout")
    loaded = store.load(store.entry(7))
    assert any(loaded.equals(make_batch(n=32, seed=s, width=2048)) for s in range(4))
    assert [p.name for p in store.directory.iterdir()] == ["7"]
    verify(store.path(7))


def test_numpy_non_tensors_keep_dtype_and_shape(store):
    batch = Batch.from_dict(
        {"x": torch.zeros(3, 1)},
        {"scores": np.array([1.5, np.nan, 2.0], dtype=np.float32), "grid": np.arange(6, dtype=np.int16).reshape(3, 2)},
    )
    store.save(1, batch)
    loaded = store.load(store.entry(1))
    assert loaded.non_tensor_batch["scores"].dtype == np.float32
    assert loaded.non_tensor_batch["grid"].shape == (3, 2)
    assert loaded.equals(batch)
