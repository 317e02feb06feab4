import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import skip_core.progress
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from skip_core import encoding, entries, files, writing
from skip_core.encoding import EncodingError
from skip_plugin_arithmetic.tiny_model import llama
from skip_plugin_trainer.train import shards
from skip_plugin_trainer.train.checkpoint import (
    LATEST,
    STEP_DIR,
    CheckpointManager,
    CheckpointWarning,
    capture_rng,
    restore_rng,
)
from skip_plugin_trainer.train.checkpoint_files import MANIFEST, STATE, TENSORS, CorruptCheckpoint
from skiptests import deep_tree
from torch import nn

# The one file a single rank's shards of the actor are (``shards.save`` with one process).
SHARD = "actor/shard-00001-model-00001-of-00001.safetensors"


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """These tests reseed the global RNGs; put them back for whatever runs next."""
    state = capture_rng()
    yield
    restore_rng(state)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint must never be unpickled")

    for module, name in [(pickle, "load"), (pickle, "loads"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def trained_shards(model: nn.Module, optimizer: torch.optim.Optimizer):
    """What the trainer hands ``save``: the model's real shards, written where the checkpoint keeps the actor's."""
    return lambda directory: {"actor": shards.save(model, optimizer, directory / "actor")}


def one_shard(tensors: dict[str, torch.Tensor] | None = None):
    """A stand-in for the models' ranks, for tests of the manager alone: one actor shard file."""

    def write(directory: Path) -> dict:
        (directory / "actor").mkdir()
        save_file(tensors or {"w": torch.arange(4.0)}, str(directory / SHARD))
        return {"actor": {"param_groups": None}}

    return write


def save_simple(manager: CheckpointManager, step: int, **trainer) -> None:
    manager.save(step, {"global_step": step, **trainer}, capture_rng(), one_shard({"w": torch.full((3,), step)}))


def test_model_and_adamw_round_trip_is_bit_exact(tmp_path, no_unpickling):
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for seed in range(3):
        train_step(model, optimizer, seed)
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"global_step": 3}, capture_rng(), trained_shards(model, optimizer))

    loaded = manager.load(3)
    assert loaded.step == 3 and loaded.path == tmp_path / "global_step_3"
    assert loaded.model is None and loaded.optimizer is None  # format 1's fields
    (groups,) = loaded.shards["actor"]["param_groups"]
    assert groups["betas"] == (0.8, 0.95) and isinstance(groups["betas"], tuple)
    fresh = make_model(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())  # its own defaults: the checkpoint's must win
    shards.load(fresh, fresh_optimizer, loaded.path / "actor", loaded.shards["actor"])
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert fresh_optimizer.param_groups[0]["weight_decay"] == 0.1
    assert set(fresh_optimizer.state_dict()["state"]) == {0, 1, 2, 3}
    assert all(torch.equal(s["step"], torch.tensor(3.0)) for s in fresh_optimizer.state.values())

    train_step(model, optimizer, 3)
    train_step(fresh, fresh_optimizer, 3)
    for original, resumed in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(original, resumed)


def test_sealing_a_checkpoint_shows_its_progress_in_megabytes_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(skip_core.progress, "EVERY_S", 0.0)  # a 7B model's minutes, at this size
    CheckpointManager(tmp_path).save(1, {"global_step": 1}, capture_rng(), one_shard({"w": torch.zeros(3 << 18)}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sealing the checkpoint")]
    assert lines and lines[-1].startswith("sealing the checkpoint 3/3 MB, ")


def test_a_model_saved_before_its_first_step_resumes_with_a_fresh_optimizer(tmp_path, no_unpickling):
    """An optimizer that never stepped has no state to keep: torch would make one up (a step of 1)."""
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(tmp_path)
    manager.save(0, {}, {}, trained_shards(model, optimizer))

    loaded = manager.load(0)
    assert loaded.shards == {"actor": {"param_groups": None}}
    fresh = make_model(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    shards.load(fresh, fresh_optimizer, loaded.path / "actor", loaded.shards["actor"])
    assert not fresh_optimizer.state
    train_step(model, optimizer, 0)
    train_step(fresh, fresh_optimizer, 0)
    for original, resumed in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(original, resumed)


def tiny_llama():
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    return llama(64, **shape, tie_word_embeddings=True).to(torch.bfloat16)


def test_tied_weights_and_dtypes_round_trip(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {}, {}, trained_shards(model, optimizer))

    loaded = manager.load(1)
    # The tied head is the embedding under a second name: stored once (safetensors refuses shared storage).
    stored = load_file(str(loaded.path / SHARD))
    assert "model.model.embed_tokens.weight" in stored and not any("lm_head" in name for name in stored)
    torch.manual_seed(1)
    fresh = tiny_llama()
    shards.load(fresh, torch.optim.AdamW(fresh.parameters()), loaded.path / "actor", loaded.shards["actor"])
    resumed = fresh.state_dict()
    assert list(resumed) == list(state)
    for key, tensor in state.items():
        assert resumed[key].dtype == torch.bfloat16 and torch.equal(resumed[key], tensor), key
    # Still one tensor: training the embedding trains the head.
    assert resumed["lm_head.weight"].data_ptr() == resumed["model.embed_tokens.weight"].data_ptr()


def test_rng_round_trip(tmp_path):
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's legacy state
    manager = CheckpointManager(tmp_path)
    manager.save(1, {}, capture_rng(), one_shard())
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(manager.load(1).rng)
    drawn = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert drawn[:2] == expected[:2]
    assert torch.equal(drawn[2], expected[2])


def test_trainer_state_keeps_types(tmp_path, no_unpickling):
    trainer = {
        "global_step": 7,
        "dataloader": {"sampler": {"generator": torch.Generator().manual_seed(3).get_state(), "yielded": 12}},
        "metrics": {"position": 3, "window": (1, 2.5, None), "by_epoch": {0: [1.0, float("inf")]}},
    }
    manager = CheckpointManager(tmp_path)
    manager.save(7, trainer, {}, one_shard())

    loaded = manager.load(7).trainer
    assert torch.equal(loaded["dataloader"]["sampler"]["generator"], trainer["dataloader"]["sampler"]["generator"])
    assert loaded["metrics"] == trainer["metrics"]
    assert loaded["global_step"] == 7
    # The generator state is a tensor: it went to state.safetensors, not into the JSON.
    assert load_file(str(tmp_path / "global_step_7" / TENSORS)).keys() == {"trainer.dataloader.sampler.generator"}


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [SHARD, STATE, TENSORS])
def test_corrupt_byte_is_caught_and_latest_falls_back(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    flip_a_byte(tmp_path / "global_step_2" / name)

    with pytest.raises(CorruptCheckpoint, match=f"{re.escape(name)} does not match its recorded hash") as caught:
        manager.load(2)
    assert caught.value.path == tmp_path / "global_step_2"
    with pytest.warns(CheckpointWarning, match="global_step_2.*hash"):
        latest = manager.latest()
    assert latest is not None and latest.step == 1


@pytest.mark.parametrize("entry", ["actor/x.safetensors", "critic/x.safetensors", "notes.txt", "actor/sub/"])
def test_a_file_the_manifest_does_not_list_is_corrupt_and_latest_falls_back(tmp_path, entry):
    """The shards' reader reads every safetensors file of its directory: one slipped in beside
    the sealed ones would be loaded unverified."""
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    target = tmp_path / "global_step_2" / entry
    target.parent.mkdir(exist_ok=True)
    if entry.endswith("/"):
        target.mkdir()
    else:
        save_file({"w": torch.zeros(3)}, str(target))

    with pytest.raises(CorruptCheckpoint, match=f"holds {re.escape(entry.rstrip('/'))}, which its manifest does not"):
        manager.load(2)
    with pytest.warns(CheckpointWarning, match="global_step_2: holds"):
        assert manager.latest().step == 1


def test_a_tree_deeper_than_the_recursion_limit_is_corrupt_not_a_recursion_error(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    deep = deep_tree(tmp_path / "global_step_2" / "actor" / "d")
    try:
        with pytest.warns(CheckpointWarning, match="global_step_2: holds actor/d, which its manifest does not list"):
            assert manager.latest().step == 1
    finally:  # pytest's clean-up of old temporary directories recurses
        files.delete_tree(deep)


def test_a_models_directory_linked_elsewhere_is_corrupt(tmp_path):
    """The search for unlisted files does not follow a link: behind ``actor`` the shards' reader
    would find files no manifest sealed, here a second rank's."""
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(tmp_path / "global_step_1" / "actor", elsewhere)
    save_file({"w": torch.ones(3)}, str(elsewhere / "shard-00002-model-00001-of-00001.safetensors"))
    (tmp_path / "global_step_1" / "actor").symlink_to(elsewhere)

    with pytest.raises(CorruptCheckpoint, match="through a symbolic link"):
        manager.load(1)


def test_an_empty_directory_of_a_model_that_saved_nothing_is_no_damage(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    (tmp_path / "global_step_1" / "critic").mkdir()
    assert manager.load(1).step == 1


def list_in_manifest(checkpoint: Path, name: str, file: Path) -> None:
    """Add ``name`` to the manifest with ``file``'s true size and hash: only its name can fail."""
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(3)}, str(file))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = entries.seal(file)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name",
    [
        "../x.safetensors",  # outside the checkpoint
        "actor/../x.safetensors",
        "actor/sub/x.safetensors",  # the models' directories are flat
        "critic/x.bin",  # not safetensors
        "policy/x.safetensors",  # not a trained model's directory
        "actor/.x.safetensors",
        "model.safetensors",  # format 1's file, in a format 2 checkpoint
    ],
)
def test_a_manifest_listing_a_name_no_checkpoint_file_has_is_corrupt(tmp_path, name):
    manager = CheckpointManager(tmp_path / "root")
    save_simple(manager, 1)
    checkpoint = tmp_path / "root" / "global_step_1"
    list_in_manifest(checkpoint, name, Path(os.path.normpath(checkpoint / name)))

    with pytest.raises(CorruptCheckpoint, match=r"manifest lists files \[") as caught:
        manager.load(1)
    assert name in caught.value.reason


@pytest.mark.parametrize(
    "shards",
    [5, {}, {"policy": {"param_groups": None}}, {"actor": 5}, {"actor": {"param_groups": "lr"}}, {"actor": {}}],
)
def test_a_state_recording_shards_no_model_can_read_is_corrupt(tmp_path, shards):
    """A hand-written state.json, hashed again: what the ranks would be handed is checked before
    they are, so a resume says so in one line instead of failing inside a worker."""
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    checkpoint = tmp_path / "global_step_1"
    state = json.loads((checkpoint / STATE).read_text())
    state["shards"] = shards
    (checkpoint / STATE).write_text(json.dumps(state))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][STATE] = entries.seal(checkpoint / STATE)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CorruptCheckpoint, match=r"cannot decode: state\.json records"):
        manager.load(1)


def test_a_manifest_without_the_state_tensors_is_corrupt(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    manifest = json.loads((tmp_path / "global_step_1" / MANIFEST).read_text())
    del manifest["files"][TENSORS]
    (tmp_path / "global_step_1" / TENSORS).unlink()
    (tmp_path / "global_step_1" / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CorruptCheckpoint, match="manifest lists files"):
        manager.load(1)


# -- format 1: one process's checkpoints, written before sharding, still read ------------------


def old_split(value, key, tensors):
    """Format 1's ``_split``, as it was: tensors to safetensors, a reference left in the JSON."""
    if isinstance(value, torch.Tensor):
        name = key or "tensor"
        while name in tensors:
            name += "_"
        tensors[name] = value
        return {"__skip_tensor__": name}
    if isinstance(value, dict):
        return {k: old_split(v, f"{key}.{k}" if key else str(k), tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [old_split(v, f"{key}.{i}" if key else str(i), tensors) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def write_format_1(directory: Path, step: int, model, optimizer, trainer, rng) -> None:
    """A checkpoint as the one-process writer made it (``checkpoint_files.write`` before format 2)."""
    directory.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "model_keys": list(model),
        "optimizer": encoding.encode(old_split(optimizer, "", tensors), "optimizer"),
        "trainer": encoding.encode(old_split(trainer, "trainer", tensors), "trainer"),
        "rng": encoding.encode(old_split(rng, "rng", tensors), "rng"),
    }
    files.write_synced(directory / "state.json", json.dumps(state).encode())
    save_file(encoding.storable(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_file(encoding.storable(tensors), str(directory / "optimizer.safetensors"), metadata={"format": "pt"})
    manifest = {
        "format": "skip-checkpoint",
        "version": 1,
        "step": step,
        "files": {
            name: entries.seal(directory / name) for name in ("model.safetensors", "optimizer.safetensors", STATE)
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    files.write_synced(directory / MANIFEST, json.dumps(manifest, indent=1).encode())


def test_a_format_1_checkpoint_is_still_read_and_resumes_bit_exact(tmp_path, no_unpickling):
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for seed in range(3):
        train_step(model, optimizer, seed)
    rng = capture_rng()
    write_format_1(tmp_path / "global_step_3", 3, model.state_dict(), optimizer.state_dict(), {"global_step": 3}, rng)

    loaded = CheckpointManager(tmp_path).latest()
    assert loaded.step == 3 and loaded.shards is None
    assert loaded.trainer == {"global_step": 3} and torch.equal(loaded.rng["torch"], rng["torch"])
    assert list(loaded.model) == list(model.state_dict())
    assert loaded.optimizer["param_groups"][0]["betas"] == (0.8, 0.95)
    fresh = make_model(1)
    fresh.load_state_dict(loaded.model)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh_optimizer.load_state_dict(loaded.optimizer)
    train_step(model, optimizer, 3)
    train_step(fresh, fresh_optimizer, 3)
    for original, resumed in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(original, resumed)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", STATE])
def test_a_format_1_checkpoint_is_verified_as_before(tmp_path, name):
    model = make_model(0)
    write_format_1(tmp_path / "global_step_1", 1, model.state_dict(), {}, {}, {})
    flip_a_byte(tmp_path / "global_step_1" / name)

    with pytest.raises(CorruptCheckpoint, match=f"{re.escape(name)} does not match its recorded hash"):
        CheckpointManager(tmp_path).load(1)


def test_checkpoint_without_manifest_is_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    shutil.copytree(tmp_path / "global_step_1", tmp_path / "global_step_2")
    (tmp_path / "global_step_2" / "manifest.json").unlink()

    assert manager.steps() == [1]
    assert manager.latest().step == 1
    with pytest.raises(CorruptCheckpoint, match=r"manifest\.json is missing"):
        manager.load(2)


def owned_by_a_process_that_is_gone(prefix: str) -> str:
    code = f"from skip_core.files import owned; print(owned({prefix!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_a_save_removes_the_leftovers_of_killed_saves_never_a_live_ones(tmp_path):
    """Another run saving into the same root right now owns its temp directory: deleting it would
    cost that run its checkpoint. Only names whose process is gone are leftovers."""
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    killed = [
        owned_by_a_process_that_is_gone(".tmp-global_step_3-") + "a1b2",
        owned_by_a_process_that_is_gone(".trash-global_step_2-") + "c3d4",
        owned_by_a_process_that_is_gone(f".{LATEST}.") + "e5f6.tmp",
    ]
    kept = [
        files.owned(".tmp-global_step_3-") + "live",  # this process's: a save in progress
        ".tmp-global_step_3-unmarked",  # whose process no one can ask
        ".tmp-not-ours",  # another writer's
    ]
    for name in killed[:2] + kept[:2]:
        shutil.copytree(tmp_path / "global_step_1", tmp_path / name)
    for name in killed[2:] + kept[2:]:
        (tmp_path / name).write_text("1")

    save_simple(manager, 4)
    assert sorted(os.listdir(tmp_path)) == sorted(["global_step_1", "global_step_4", LATEST, *kept])


def test_empty_root_has_no_latest(tmp_path):
    assert CheckpointManager(tmp_path / "absent").latest() is None


def fail_sealing(monkeypatch):
    def seal(path):
        raise OSError("disk full")

    monkeypatch.setattr(entries, "seal", seal)
    return OSError, {}


def fail_publishing(monkeypatch):
    def publish(tmp, final):
        raise OSError("rename failed")

    monkeypatch.setattr(files, "publish", publish)
    return OSError, {}


def fail_writing_shards(monkeypatch):
    """A rank's disk fills halfway through its file."""

    def save(model, optimizer, directory):
        directory.mkdir()
        (directory / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(shards, "save", save)
    return OSError, {}


def unstorable_trainer(monkeypatch):
    return EncodingError, {"bad": object()}


@pytest.mark.parametrize("inject", [unstorable_trainer, fail_writing_shards, fail_sealing, fail_publishing])
@pytest.mark.parametrize("step", [2, 1])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, inject, step):
    manager = CheckpointManager(tmp_path)
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(model, optimizer, 0)
    manager.save(1, {"global_step": 1}, {}, trained_shards(model, optimizer))
    before = load_file(str(tmp_path / "global_step_1" / SHARD))
    error, trainer = inject(monkeypatch)
    train_step(model, optimizer, 1)

    with pytest.raises(error):
        manager.save(step, {"global_step": step, **trainer}, {}, trained_shards(model, optimizer))

    assert sorted(os.listdir(tmp_path)) == ["global_step_1", LATEST]
    assert (tmp_path / LATEST).read_text() == "1"
    after = manager.latest()
    assert after.step == 1 and after.trainer == {"global_step": 1}
    stored = load_file(str(after.path / SHARD))
    assert stored.keys() == before.keys() and all(torch.equal(stored[k], v) for k, v in before.items())


def test_unstorable_trainer_state_fails_before_the_models_write_a_byte(tmp_path):
    written = []

    def record(directory):
        written.append(directory)
        return {}

    with pytest.raises(EncodingError):
        CheckpointManager(tmp_path).save(1, {"bad": object()}, {}, record)
    assert written == []


def test_save_replaces_existing_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {}, {}, one_shard({"w": torch.zeros(2)}))
    manager.save(1, {}, {}, one_shard({"w": torch.ones(2)}))

    assert torch.equal(load_file(str(manager.load(1).path / SHARD))["w"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", LATEST]


def test_keep_prunes_oldest_and_latest_file_names_the_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in [1, 2, 3, 4]:
        save_simple(manager, step)
        assert (tmp_path / LATEST).read_text() == str(step)

    assert manager.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", "global_step_4", LATEST]
    assert manager.latest().step == 4


def test_rejects_bad_steps_and_paths_outside_root(tmp_path):
    manager = CheckpointManager(tmp_path / "root")
    with pytest.raises(ValueError, match="negative"):
        manager.save(-1, {}, {}, one_shard())
    with pytest.raises(TypeError):
        manager.save(1.5, {}, {}, one_shard())
    save_simple(CheckpointManager(tmp_path / "elsewhere"), 5)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "global_step_5").symlink_to(tmp_path / "elsewhere" / "global_step_5")

    with pytest.raises(CorruptCheckpoint, match="outside"):
        manager.load(5)


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_never_costs_the_one_resumed_from(tmp_path):
    """Pruning by step alone would keep the corrupt step 3 and delete step 2, the last good one."""
    for step in (1, 2, 3):
        save_simple(CheckpointManager(tmp_path, keep=2), step)
    flip_a_byte(tmp_path / "global_step_3" / SHARD)

    manager = CheckpointManager(tmp_path, keep=2)  # the resumed run's
    with pytest.warns(CheckpointWarning, match=f"ignoring checkpoint .*global_step_3: {re.escape(SHARD)}"):
        resumed = manager.latest()
    assert resumed.step == 2
    manager.pin(resumed.path)  # what find_checkpoint does with the checkpoint a run resumes from
    with pytest.warns(CheckpointWarning) as caught:
        save_simple(manager, 4)

    aside = tmp_path / "global_step_3.corrupt"
    (warning,) = [str(w.message) for w in caught]
    assert f"{tmp_path / 'global_step_3'} does not verify" in warning and f"moved it aside to {aside}," in warning
    assert aside.is_dir() and manager.steps() == [2, 4]
    for step in (5, 6):
        save_simple(manager, step)
    assert sorted(os.listdir(tmp_path)) == [
        "global_step_2",
        "global_step_3.corrupt",
        "global_step_5",
        "global_step_6",
        LATEST,
    ]
    assert manager.load(2).trainer["global_step"] == 2 and manager.latest().step == 6


def test_a_second_corrupt_checkpoint_of_a_step_is_moved_aside_beside_the_first(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    (tmp_path / "global_step_3.corrupt").mkdir(parents=True)
    save_simple(manager, 3)
    flip_a_byte(tmp_path / "global_step_3" / STATE)
    with pytest.warns(CheckpointWarning, match="ignoring checkpoint"):
        assert manager.latest() is None

    with pytest.warns(CheckpointWarning, match=r"global_step_3\.corrupt-2, where nothing loads it"):
        save_simple(manager, 1)
    assert (tmp_path / "global_step_3.corrupt-2" / MANIFEST).is_file()
    assert manager.steps() == [1] and manager.latest().step == 1


def test_pruning_hashes_only_checkpoints_this_process_has_not_verified(tmp_path, monkeypatch):
    """Hashing reads every byte of a checkpoint: those this process wrote or verified are trusted
    until their directory is replaced."""
    run = tmp_path / "run"
    manager = CheckpointManager(run, keep=2)
    for step in (1, 2):
        save_simple(manager, step)
    save_simple(CheckpointManager(tmp_path / "elsewhere"), 3)
    os.rename(tmp_path / "elsewhere" / "global_step_3", run / "global_step_3")  # another process's checkpoint
    hashed = []
    digest = entries.fd_digest

    def counted(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))  # the file the descriptor hashed is open on
        # the checkpoint it belongs to (a shard lies a directory deeper); a file sealed while saving has none
        hashed.extend(parent.name for parent in path.parents if STEP_DIR.fullmatch(parent.name))
        return digest(fd)

    monkeypatch.setattr(entries, "fd_digest", counted)
    save_simple(manager, 4)
    assert hashed == ["global_step_3"] * 3 and manager.steps() == [3, 4]  # state.json, state.safetensors, the shard
    save_simple(manager, 5)
    assert hashed == ["global_step_3"] * 3 and manager.steps() == [4, 5]


def test_a_manifest_nested_past_any_reader_is_corrupt_and_latest_falls_back(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    (tmp_path / "global_step_2" / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)

    with pytest.raises(CorruptCheckpoint, match=r"manifest\.json\b.*nested 100000 levels deep"):
        manager.load(2)
    with pytest.warns(CheckpointWarning, match=r"global_step_2: manifest\.json\b.*nested 100000 levels deep"):
        assert manager.latest().step == 1


@pytest.mark.timeout(60)  # a reader blocked on the pipe fails here, not at the suite's limit
@pytest.mark.parametrize("name", [MANIFEST, SHARD, STATE, TENSORS])
def test_a_named_pipe_in_a_checkpoint_is_corrupt_not_a_hang(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    target = tmp_path / "global_step_1" / name
    target.unlink()
    os.mkfifo(target)

    # skip_core.reading names the file alone, not its model's directory
    with pytest.raises(CorruptCheckpoint, match=f"{re.escape(Path(name).name)} .*named pipe"):
        manager.load(1)


def test_a_manifest_recording_sizes_of_another_type_is_corrupt(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    manifest = tmp_path / "global_step_1" / MANIFEST
    recorded = json.loads(manifest.read_text())
    recorded["files"][SHARD]["bytes"] = str(recorded["files"][SHARD]["bytes"])
    manifest.write_text(json.dumps(recorded))

    with pytest.raises(CorruptCheckpoint, match=f"manifest entry for {re.escape(SHARD)} is malformed"):
        manager.load(1)


def test_step_directories_of_too_many_or_foreign_digits_are_not_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    for digits in ("9" * 240, "1" * 19, "\u0663", "01"):  # 240: about the most a file name holds
        shutil.copytree(tmp_path / "global_step_1", tmp_path / f"global_step_{digits}")

    assert manager.steps() == [1]
    assert manager.latest().step == 1
    with pytest.raises(ValueError, match="at most 18 digits"):
        manager.path(10**18)


# -- what a save replaces or writes below the root ---------------------------------------------


def test_a_save_over_a_step_that_does_not_verify_moves_it_aside_never_deletes_it(tmp_path, monkeypatch):
    """A run that resumed from step 1 past a damaged step 2 saves step 2 again: the damaged one is
    kept for a look, under a name no step matches, while a good one is replaced."""
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        save_simple(manager, step)
    flip_a_byte(tmp_path / "global_step_2" / SHARD)
    damaged = (tmp_path / "global_step_2" / SHARD).read_bytes()
    monkeypatch.setattr("skip_plugin_trainer.train.checkpoint._verdicts", {})  # a new run: nothing verified yet

    with pytest.warns(CheckpointWarning) as caught:
        save_simple(CheckpointManager(tmp_path), 2)
        save_simple(CheckpointManager(tmp_path), 1)  # verifies: replaced, nothing to keep

    (warning,) = [str(w.message) for w in caught]
    aside = tmp_path / "global_step_2.corrupt"
    assert warning == (
        f"skip: checkpoint {tmp_path / 'global_step_2'} does not verify ({SHARD} does not match its recorded "
        f"hash); moved it aside to {aside}, where nothing loads it"
    )
    assert (aside / SHARD).read_bytes() == damaged
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "global_step_2", "global_step_2.corrupt", LATEST]
    assert manager.load(2).trainer["global_step"] == 2 and manager.load(1).trainer["global_step"] == 1


def test_a_link_planted_at_the_pointer_file_is_refused_never_written_through(tmp_path):
    """``latest_checkpointed_iteration.txt`` linked to a file of the user's: a save must not
    overwrite that file, nor replace the link as if it were its own."""
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("keep me")
    root = tmp_path / "run"
    root.mkdir()
    (root / LATEST).symlink_to(theirs)

    with pytest.raises(writing.UnsafeDestination, match=f"{re.escape(str(root / LATEST))} is a symbolic link"):
        save_simple(CheckpointManager(root), 1)
    assert theirs.read_text() == "keep me" and (root / LATEST).is_symlink()


# -- shards recorded again over other contents ----------------------------------------------------


def saved_twice(tmp_path) -> Path:
    """Two checkpoints of a real model's shards; the newest one's path."""
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        train_step(model, optimizer, step)
        manager.save(step, {"global_step": step}, {}, trained_shards(model, optimizer))
    return tmp_path / "global_step_2"


def resign(checkpoint: Path, keep_record: bool = True) -> None:
    """Record the shard's size and hash again, as a tool rewriting it would (its record of tensors
    kept, or dropped as a manifest written before records were kept has none)."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    entry = manifest["files"][SHARD]
    entry.update(entries.seal(checkpoint / SHARD))
    if not keep_record:
        for name, recorded in manifest["files"].items():
            recorded.pop("tensors", None) if name.startswith("actor/") else None
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def rewrite_header(file: Path, edit) -> None:
    """``file`` with its safetensors header passed through ``edit`` (the JSON object, or its bytes)."""
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = edit(json.loads(data[8 : 8 + size]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])


def as_float16(file: Path) -> str:
    """The policy's tensors stored as float16 where float32 was written."""
    with safe_open(str(file), "pt") as f:
        metadata, tensors = f.metadata(), {key: f.get_tensor(key).half() for key in f.keys()}  # noqa: SIM118
    save_file(tensors, str(file), metadata=metadata)
    return " holds model.0.bias as float16 [8] at [0], its manifest records float32 [8] at [0]"


def not_json(file: Path) -> str:
    rewrite_header(file, lambda header: b"{not json" + b" " * 7)
    return ": cannot read its safetensors header: Error while deserializing header: invalid JSON"


def overlapping_offsets(file: Path) -> str:
    def edit(header):
        header["model.0.weight"]["data_offsets"] = header["model.0.bias"]["data_offsets"]
        return header

    rewrite_header(file, edit)
    return ": cannot read its safetensors header: Error while deserializing header: invalid "  # shape or offset


def sharding_record_without_a_tensor(file: Path) -> str:
    def edit(header):
        record = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        del record["model.0.weight"]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(record)
        return header

    rewrite_header(file, edit)
    return (
        ": cannot read its safetensors header: its sharding record gives model.0.weight no offsets for its shape [8, 4]"
    )


def offsets_elsewhere(file: Path) -> str:
    def edit(header):
        record = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        record["model.0.weight"]["saved_offsets"] = [8, 0]
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(record)
        return header

    rewrite_header(file, edit)
    return " holds model.0.weight as float32 [8, 4] at [8, 0], its manifest records float32 [8, 4] at [0, 0]"


@pytest.mark.parametrize(
    "damage", [as_float16, not_json, overlapping_offsets, sharding_record_without_a_tensor, offsets_elsewhere]
)
def test_a_shard_recorded_again_over_what_its_reader_refuses_or_misreads_is_corrupt(tmp_path, damage):
    """Its hash verifies: the header, read alone, is held to what the manifest recorded of it, so no
    rank ever gets to read it (float16 would have been cast into the float32 model without a word)."""
    checkpoint = saved_twice(tmp_path)
    reason = damage(checkpoint / SHARD)
    resign(checkpoint)

    with pytest.raises(CorruptCheckpoint) as caught:
        CheckpointManager(tmp_path).load(2)
    assert caught.value.reason.startswith(SHARD + reason)
    with pytest.warns(CheckpointWarning, match=f"ignoring checkpoint {re.escape(str(checkpoint))}: "):
        assert CheckpointManager(tmp_path).latest().step == 1


@pytest.mark.parametrize("damage", [not_json, overlapping_offsets, sharding_record_without_a_tensor])
def test_a_checkpoint_written_before_records_still_has_its_headers_checked(tmp_path, damage):
    checkpoint = saved_twice(tmp_path)
    resign(checkpoint, keep_record=False)
    assert CheckpointManager(tmp_path).load(2).step == 2  # no record: still read
    reason = damage(checkpoint / SHARD)
    resign(checkpoint, keep_record=False)

    with pytest.raises(CorruptCheckpoint, match=re.escape(SHARD + reason)):
        CheckpointManager(tmp_path).load(2)


@pytest.mark.parametrize(
    ("damage", "misfit"),
    [
        (as_float16, "model.0.weight is stored as float16 [8, 4], this model's is float32 [8, 4]"),
        (offsets_elsewhere, "model.0.weight is stored as float32 [16, 4], this model's is float32 [8, 4]"),
    ],
    ids=["float16", "offsets"],
)
def test_a_rank_refuses_shards_that_do_not_fit_its_model_where_no_record_tells(tmp_path, damage, misfit):
    """Without a record the header alone looks right; the rank holds it to its own tensors before
    reading a byte of them (dcp would cast float16 silently) and says which, in one line."""
    checkpoint = saved_twice(tmp_path)
    damage(checkpoint / SHARD)
    resign(checkpoint, keep_record=False)
    loaded = CheckpointManager(tmp_path).load(2)

    fresh = make_model(1)
    before = [parameter.detach().clone() for parameter in fresh.parameters()]
    with pytest.raises(shards.UnreadableShards) as caught:
        shards.load(fresh, torch.optim.AdamW(fresh.parameters()), loaded.path / "actor", loaded.shards["actor"])
    assert str(caught.value) == misfit
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
