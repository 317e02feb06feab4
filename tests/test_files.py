"""What skip writes gets the modes the user's umask gives, as ``open()`` and ``mkdir()`` would."""

import os
import stat

import pytest
import torch
from conftest import make_prompts
from skip_core import files
from skip_core.arithmetic import write_parquet
from skip_core.checkpoint import CheckpointManager
from skip_core.config import Namespace
from skip_core.metrics import plot
from skip_core.store import CacheStore


@pytest.fixture(params=[0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def modes(root) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by relative path."""
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def assert_umask_modes(root, mask: int) -> None:
    for name, mode in modes(root).items():
        expected = (0o777 if (root / name).is_dir() else 0o666) & ~mask
        assert mode == expected, f"{name}: {mode:o}, expected {expected:o}"


def test_the_umask_is_read_without_changing_it(umask):
    assert files.current_umask() == umask
    assert os.umask(umask) == umask


def test_a_cache_entry_gets_the_umask_modes(tmp_path, umask):
    entry = CacheStore(tmp_path, Namespace("exp", "proj"), role="rollout").save(1, make_prompts())
    assert_umask_modes(entry, umask)


def test_a_checkpoint_gets_the_umask_modes(tmp_path, umask):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, torch.nn.Linear(2, 2).state_dict(), {}, {"global_step": 1}, {})
    assert_umask_modes(tmp_path / "ckpt", umask)


def test_files_replaced_atomically_get_the_umask_modes(tmp_path, umask):
    plot([{"step": 1, "critic/score/mean": 0.5, "timing_s/step": 1.0}], tmp_path / "out" / "plot.png")
    write_parquet([{"a": 1}], tmp_path / "out" / "data.parquet")
    files.write_atomic(tmp_path / "out" / "metrics.jsonl", b"{}\n")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data.parquet", "metrics.jsonl", "plot.png"]
    assert_umask_modes(tmp_path / "out", umask)


def test_a_published_directory_gets_the_umask_modes_whatever_its_writers_chose(tmp_path, umask):
    tmp = tmp_path / ".tmp-1"
    (tmp / "nested").mkdir(parents=True, mode=0o700)
    (tmp / "nested" / "weights.safetensors").touch(mode=0o600)
    os.chmod(tmp, 0o700)
    files.publish(tmp, tmp_path / "entry")
    assert_umask_modes(tmp_path / "entry", umask)


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old")
    with pytest.raises(RuntimeError), files.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
