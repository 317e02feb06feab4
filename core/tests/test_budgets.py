"""What a cache costs to read is bounded by its bytes on disk, and no tree is too deep to walk.

A ``data.json`` of kilobytes can declare gigabytes (a ``<U100000000`` dtype is 400 MB an item) and
one of megabytes can hold tens of millions of empty lists; both are refused before they are
built, in one warning, then a miss. The peak memory of a load is measured in a fresh process
(``ru_maxrss``), against the same process's baseline, never against a clock.
"""

import json
import os
import subprocess
import sys

from click.testing import CliRunner
from skip_core import reading
from skip_core.cli import cli
from skip_core.entries import META, seal
from skip_core.files import delete_tree
from skip_core.store import CacheStore
from skiptests import NS, deep_tree, make_batch

_LOAD = """
import json, resource, sys, warnings
from pathlib import Path
sys.path[:0] = [{shared!r}]
from skip_core.store import CacheStore
from skiptests import NS
store = CacheStore({cache!r}, NS, role="rollout")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
problem = None
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    entry = store.entry(1)
    try:
        store.load(entry)
    except Exception as exc:
        problem = f"{{type(exc).__name__}}: {{exc}}"
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({{"problem": problem, "said": [str(w.message) for w in said], "grown_kb": grown}}))
"""


def load_in_a_fresh_process(cache) -> dict:
    shared = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
    code = _LOAD.format(shared=os.path.abspath(shared), cache=str(cache))
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def resealed_with(tmp_path, data: bytes):
    """An entry whose ``data.json`` is ``data``, its size and hash recorded as someone covering it would."""
    store = CacheStore(tmp_path / "cache", NS, role="rollout")
    entry = store.save(1, make_batch())
    (entry / "data.json").write_bytes(data)
    meta = json.loads((entry / META).read_text())
    meta["files"]["data.json"] = seal(entry / "data.json")
    (entry / META).write_text(json.dumps(meta))
    return tmp_path / "cache"


def test_a_fixed_width_dtype_declaring_gigabytes_in_kilobytes_is_refused_before_numpy_allocates(tmp_path):
    items = ["x"] * 6
    array = {"__skip__": "ndarray", "dtype": "<U100000000", "shape": [len(items)], "items": items}
    data = json.dumps({"non_tensor_batch": {"uid": array}, "meta_info": {}}).encode()
    assert len(data) < 200
    result = load_in_a_fresh_process(resealed_with(tmp_path, data))
    assert result["problem"] == (
        "CorruptEntry: cannot load it: its arrays (the last: 6 items of <U100000000) declare more than the "
        f"{reading.JSON_FLOOR} bytes allowed for its {len(data)} bytes"
    )
    assert result["grown_kb"] < 100_000  # was 2.3 GB: six items of 400 MB


def test_millions_of_empty_lists_are_refused_before_they_are_built(tmp_path):
    data = b'{"non_tensor_batch": {}, "meta_info": {"x": [' + b"[]," * 8_000_000 + b"[]]}}"
    result = load_in_a_fresh_process(resealed_with(tmp_path, data))
    containers = data.count(b"[") + data.count(b"{")
    assert result["problem"] == (
        f"CorruptEntry: cannot load it: data.json: its {containers} lists and objects in {len(data)} bytes would "
        f"take about {(8 * len(data) + 72 * containers) >> 20} MiB to read, more than 16 times its size"
    )
    assert result["grown_kb"] < 200_000  # the 24 MB text, read once; building it took about 600 MB


def test_a_batchs_messages_cost_less_than_the_budget_allows():
    """The estimate must never refuse what skip writes: many short chat messages, the costliest kind."""
    message = {"role": "tool", "content": "19", "tool_calls": []}
    data = json.dumps({"items": [[message] * 3 for _ in range(300_000)]}).encode()
    assert len(data) > reading.JSON_FLOOR // reading.JSON_AMPLIFICATION  # past the floor: the ratio decides
    assert reading.loads(data)["items"][-1][-1] == message


def test_a_tree_deeper_than_pythons_recursion_limit_is_walked(tmp_path):
    store = CacheStore(tmp_path / "cache", NS, role="rollout")
    store.save(1, make_batch())
    deep = deep_tree(tmp_path / "cache" / "nested")
    try:
        assert sum(1 for _ in reading.walk(tmp_path / "cache")) > 1_100
        for command in (["ls"], ["verify"], ["prune", "--dry-run"], ["prune"]):
            result = CliRunner().invoke(cli, ["cache", *command, str(tmp_path / "cache")], catch_exceptions=False)
            assert result.exit_code == 0, result.output
        assert "all 1 entries verified" in CliRunner().invoke(cli, ["cache", "verify", str(tmp_path / "cache")]).output
    finally:  # pytest's own clean-up of old temporary directories recurses, and would end in a RecursionError
        delete_tree(deep)
