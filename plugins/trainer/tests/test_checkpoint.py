import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from skip_core import files, store
from skip_core.encoding import EncodingError
from skip_plugin_trainer.train.checkpoint import (
    LATEST,
    STEP_DIR,
    CheckpointManager,
    CheckpointWarning,
    capture_rng,
    restore_rng,
)
from skip_plugin_trainer.train.checkpoint_files import MANIFEST, MODEL, STATE, CorruptCheckpoint
from torch import nn


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


def save_simple(manager: CheckpointManager, step: int, **trainer) -> None:
    model = make_model(step)
    manager.save(step, model.state_dict(), {}, {"global_step": step, **trainer}, capture_rng())


def test_model_and_adamw_round_trip_is_bit_exact(tmp_path, no_unpickling):
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for seed in range(3):
        train_step(model, optimizer, seed)
    manager = CheckpointManager(tmp_path)
    manager.save(3, model.state_dict(), optimizer.state_dict(), {"global_step": 3}, capture_rng())

    loaded = manager.load(3)
    assert loaded.step == 3 and loaded.path == tmp_path / "global_step_3"
    assert loaded.optimizer["param_groups"][0]["betas"] == (0.8, 0.95)
    assert isinstance(loaded.optimizer["param_groups"][0]["betas"], tuple)
    assert set(loaded.optimizer["state"]) == {0, 1, 2, 3}
    assert loaded.optimizer["state"][0]["step"].shape == ()
    fresh = make_model(1)
    fresh.load_state_dict(loaded.model)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh_optimizer.load_state_dict(loaded.optimizer)

    train_step(model, optimizer, 3)
    train_step(fresh, fresh_optimizer, 3)
    for original, resumed in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(original, resumed)


def test_tied_weights_and_dtypes_round_trip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {}, {}, {})

    loaded = manager.load(1).model
    assert list(loaded) == list(state)
    for key, tensor in state.items():
        assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], tensor)
    LlamaForCausalLM(config).to(torch.bfloat16).load_state_dict(loaded)


def test_rng_round_trip(tmp_path):
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's legacy state
    manager = CheckpointManager(tmp_path)
    manager.save(1, {}, {}, {}, capture_rng())
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(manager.load(1).rng)
    drawn = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert drawn[:2] == expected[:2]
    assert torch.equal(drawn[2], expected[2])


def test_trainer_state_keeps_types(tmp_path):
    trainer = {
        "global_step": 7,
        "dataloader": {"sampler": {"generator": torch.Generator().manual_seed(3).get_state(), "yielded": 12}},
        "metrics": {"position": 3, "window": (1, 2.5, None), "by_epoch": {0: [1.0, float("inf")]}},
    }
    manager = CheckpointManager(tmp_path)
    manager.save(7, {}, {}, trainer, {})

    loaded = manager.load(7).trainer
    assert torch.equal(loaded["dataloader"]["sampler"]["generator"], trainer["dataloader"]["sampler"]["generator"])
    assert loaded["metrics"] == trainer["metrics"]
    assert loaded["global_step"] == 7


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_corrupt_byte_is_caught_and_latest_falls_back(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    target = tmp_path / "global_step_2" / name
    data = bytearray(target.read_bytes())
    data[-2] ^= 0x01
    target.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpoint, match="hash") as caught:
        manager.load(2)
    assert caught.value.path == tmp_path / "global_step_2"
    with pytest.warns(CheckpointWarning, match="global_step_2.*hash"):
        latest = manager.latest()
    assert latest is not None and latest.step == 1


def test_checkpoint_without_manifest_is_ignored(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    shutil.copytree(tmp_path / "global_step_1", tmp_path / "global_step_2")
    (tmp_path / "global_step_2" / "manifest.json").unlink()
    shutil.copytree(tmp_path / "global_step_1", tmp_path / ".tmp-global_step_3-killed")
    (tmp_path / ".tmp-not-ours").write_text("another writer's temp file")

    assert manager.steps() == [1]
    assert manager.latest().step == 1
    with pytest.raises(CorruptCheckpoint, match=r"manifest\.json is missing"):
        manager.load(2)
    save_simple(manager, 4)
    assert not (tmp_path / ".tmp-global_step_3-killed").exists()
    assert (tmp_path / ".tmp-not-ours").exists()


def test_empty_root_has_no_latest(tmp_path):
    assert CheckpointManager(tmp_path / "absent").latest() is None


def fail_sealing(monkeypatch):
    def seal(path):
        raise OSError("disk full")

    monkeypatch.setattr(store, "seal", seal)
    return OSError, {}


def fail_publishing(monkeypatch):
    def publish(tmp, final):
        raise OSError("rename failed")

    monkeypatch.setattr(files, "publish", publish)
    return OSError, {}


def unstorable_trainer(monkeypatch):
    return EncodingError, {"bad": object()}


@pytest.mark.parametrize("inject", [unstorable_trainer, fail_sealing, fail_publishing])
@pytest.mark.parametrize("step", [2, 1])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, inject, step):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    before = manager.load(1)
    error, trainer = inject(monkeypatch)

    with pytest.raises(error):
        save_simple(manager, step, **trainer)

    assert sorted(os.listdir(tmp_path)) == ["global_step_1", LATEST]
    assert (tmp_path / LATEST).read_text() == "1"
    after = manager.latest()
    assert after.step == 1 and all(torch.equal(after.model[k], v) for k, v in before.model.items())


def test_save_replaces_existing_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"w": torch.zeros(2)}, {}, {}, {})
    manager.save(1, {"w": torch.ones(2)}, {}, {}, {})

    assert torch.equal(manager.load(1).model["w"], torch.ones(2))
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
        manager.save(-1, {}, {}, {}, {})
    with pytest.raises(TypeError):
        manager.save(1.5, {}, {}, {}, {})
    save_simple(CheckpointManager(tmp_path / "elsewhere"), 5)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "global_step_5").symlink_to(tmp_path / "elsewhere" / "global_step_5")

    with pytest.raises(CorruptCheckpoint, match="outside"):
        manager.load(5)


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_never_costs_the_one_resumed_from(tmp_path):
    """Pruning by step alone would keep the corrupt step 3 and delete step 2, the last good one."""
    for step in (1, 2, 3):
        save_simple(CheckpointManager(tmp_path, keep=2), step)
    flip_a_byte(tmp_path / "global_step_3" / MODEL)

    manager = CheckpointManager(tmp_path, keep=2)  # the resumed run's
    with pytest.warns(CheckpointWarning, match=r"ignoring checkpoint .*global_step_3: model\.safetensors"):
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
    digest = store.fd_digest

    def counted(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))  # the file the descriptor hashed is open on
        if STEP_DIR.fullmatch(path.parent.name):  # a checkpoint verified, not a file sealed while saving
            hashed.append(path.parent.name)
        return digest(fd)

    monkeypatch.setattr(store, "fd_digest", counted)
    save_simple(manager, 4)
    assert hashed == ["global_step_3"] * 3 and manager.steps() == [3, 4]
    save_simple(manager, 5)
    assert hashed == ["global_step_3"] * 3 and manager.steps() == [4, 5]


def test_a_manifest_nested_past_any_reader_is_corrupt_and_latest_falls_back(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    save_simple(manager, 2)
    (tmp_path / "global_step_2" / MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)

    with pytest.raises(CorruptCheckpoint, match=r"manifest\.json .*nested 100000 levels deep"):
        manager.load(2)
    with pytest.warns(CheckpointWarning, match=r"global_step_2: manifest\.json .*nested 100000 levels deep"):
        assert manager.latest().step == 1


@pytest.mark.timeout(60)  # a reader blocked on the pipe fails here, not at the suite's limit
@pytest.mark.parametrize("name", [MANIFEST, MODEL, STATE])
def test_a_named_pipe_in_a_checkpoint_is_corrupt_not_a_hang(tmp_path, name):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    target = tmp_path / "global_step_1" / name
    target.unlink()
    os.mkfifo(target)

    with pytest.raises(CorruptCheckpoint, match=f"{name} .*named pipe"):
        manager.load(1)


def test_a_manifest_recording_sizes_of_another_type_is_corrupt(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_simple(manager, 1)
    manifest = tmp_path / "global_step_1" / MANIFEST
    recorded = json.loads(manifest.read_text())
    recorded["files"][MODEL]["bytes"] = str(recorded["files"][MODEL]["bytes"])
    manifest.write_text(json.dumps(recorded))

    with pytest.raises(CorruptCheckpoint, match=r"manifest entry for model\.safetensors is malformed"):
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
