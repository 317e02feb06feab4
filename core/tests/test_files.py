"""What skip writes gets the modes the user's umask gives, as ``open()`` and ``mkdir()`` would."""

import os

from skip_core import files
from skip_core.config import Namespace
from skip_core.store import CacheStore
from skiptests import assert_umask_modes, deep_tree, make_prompts


def test_the_umask_is_read_without_changing_it(umask):
    assert files.current_umask() == umask
    assert os.umask(umask) == umask


def test_a_cache_entry_gets_the_umask_modes(tmp_path, umask):
    entry = CacheStore(tmp_path, Namespace("exp", "proj"), role="rollout").save(1, make_prompts())
    assert_umask_modes(entry, umask)


def test_a_published_directory_gets_the_umask_modes_whatever_its_writers_chose(tmp_path, umask):
    tmp = tmp_path / ".tmp-1"
    (tmp / "nested").mkdir(parents=True, mode=0o700)
    (tmp / "nested" / "weights.safetensors").touch(mode=0o600)
    os.chmod(tmp, 0o700)
    files.publish(tmp, tmp_path / "entry")
    assert_umask_modes(tmp_path / "entry", umask)


def test_a_tree_deeper_than_the_recursion_limit_is_deleted_and_no_link_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    top = deep_tree(tmp_path / ".tmp-global_step_3-x")
    os.symlink(outside, top / "d" / "link")
    (top / "d" / "file").write_text("x")
    files.delete_tree(top)
    assert not os.path.lexists(top)
    assert (outside / "keep.txt").read_text() == "mine"
