"""Hostile ``gen_batch.dp`` and ``tq_batch.pt`` files (``hostile_cases``): each is refused with one
line of the reader's own errors, nothing it builds escapes as a foreign object, and none crashes
the process or costs more memory than its size allows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from skip_plugin_verl.dumps.tq_pickle import _TqUnpickler, decode_tq_batch, read_tq_batch
from skip_plugin_verl.dumps.verl_pickle import _OuterUnpickler, read_gen_batch

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("hostile_cases", HERE / "hostile_cases.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)
F, CASES, refusal, assert_plain_batch = H.F, H.CASES, H.refusal, H.assert_plain_batch
REAL_DUMP = HERE / "data/verl/dump_default/qwen-grpo_skip-fixture/GBS2_N2_in8_out8/1/gen_batch.dp"
SHARED_TEXT = [("BINUNICODE", "x" * 65536)]  # 64 KiB, referenced from a list many times over (2 bytes each)


def written(tmp_path: Path, payload: bytes, name: str = "gen_batch.dp") -> Path:
    path = tmp_path / name
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize(("payload", "message"), list(CASES.values()), ids=list(CASES))
def test_a_hostile_dump_is_refused_in_one_line_of_the_readers_own(tmp_path, payload, message):
    refusal(read_gen_batch, written(tmp_path, payload), message)
    assert_plain_batch(read_gen_batch(REAL_DUMP))  # the refusal changed none of the allowed globals


@pytest.mark.parametrize(("payload", "message"), list(H.TQ_CASES.values()), ids=list(H.TQ_CASES))
def test_a_hostile_tq_dump_is_refused_in_one_line_of_the_readers_own(tmp_path, payload, message):
    refusal(read_tq_batch, written(tmp_path, payload, "tq_batch.pt"), message)


def test_an_object_array_over_the_address_of_a_function_never_returns_it(tmp_path):
    """The probe's case, in this process: before the fix, ``os.system`` itself came back (in a
    fresh interpreter any other address crashed it: ``object-over-bytes``, imported below)."""
    for flags in (0, 63):
        path = written(tmp_path, H.object_over_bytes(flags, id(os.system)))
        refusal(read_gen_batch, path, "whose values are not a list of that many")


# BUILD sets a global's attributes from a dict, sets its slots from (dict, slots), or calls its
# __setstate__ with the state (here numpy's array state)
BUILD_STATES = {"dict": [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "x"), ("BININT1", 1), ("SETITEM", None)]}
BUILD_STATES["slots"] = [("NONE", None), *BUILD_STATES["dict"], ("TUPLE2", None)]
BUILD_STATES["setstate"] = F.push((1, (1,), None, False, b""))


def build_on(key: tuple[str, str], state: str) -> list:
    return [("GLOBAL", key), *BUILD_STATES[state], ("BUILD", None)]


@pytest.mark.parametrize("state", list(BUILD_STATES))
@pytest.mark.parametrize("key", sorted(_OuterUnpickler.allowed), ids=".".join)
def test_build_cannot_modify_a_global_of_the_dataproto_pickle(tmp_path, key, state):
    refusal(read_gen_batch, written(tmp_path, F.meta(build_on(key, state))), ".")
    assert_plain_batch(read_gen_batch(REAL_DUMP))


@pytest.mark.parametrize("state", list(BUILD_STATES))
@pytest.mark.parametrize("key", sorted(_TqUnpickler.allowed), ids=".".join)
def test_build_cannot_modify_a_global_of_the_torch_archive(tmp_path, key, state):
    """The tq reader's globals are the archive reader's and more: tried through both readers."""
    archive = F.torch_archive(build_on(key, state), {})
    refusal(decode_tq_batch, written(tmp_path, archive, "tq_batch.pt"), ".")
    refusal(read_gen_batch, written(tmp_path, H.in_batch(archive)), ".")
    assert_plain_batch(read_gen_batch(REAL_DUMP))


def test_what_a_dump_may_hold_comes_back_as_plain_values(tmp_path):
    values = [None, True, 3, 2.5, "é\x00", b"\x01", (1, "a"), {"k": [1.5]}, {(1, 2): "t"}]
    numbers = F.array((2, 3), H.I8, F.push(bytes(range(48))), fortran=True)
    meta = {
        "numbers": numbers,
        "words": F.array((2,), F.dtype("U2"), F.push("abcd".encode("utf-32-le"))),
        "scalar": F.scalar(F.dtype("f8"), struct.pack("<d", 0.5)),
        "nested": F.array((1,), H.OBJECT, [("EMPTY_LIST", None), *numbers, ("APPEND", None)]),
    }
    items = [op for key, ops in meta.items() for op in [("SHORT_BINUNICODE", key), *ops]]
    column = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "o"), *F.array((9,), H.OBJECT, F.push(values))]
    state = F.dataproto_state(
        H.NONE, [*column, ("SETITEM", None)], [*H.EMPTY, ("MARK", None), *items, ("SETITEMS", None)]
    )
    batch = read_gen_batch(written(tmp_path, F.dataproto(state)))
    assert_plain_batch(batch)
    assert list(batch.non_tensor_batch["o"]) == values
    fortran = np.frombuffer(bytes(range(48)), "<i8").reshape(2, 3, order="F")
    assert np.array_equal(batch.meta_info["numbers"], fortran) and batch.meta_info["numbers"].flags.writeable
    assert batch.meta_info["words"].tolist() == ["ab", "cd"]
    assert type(batch.meta_info["scalar"]) is np.float64 and batch.meta_info["scalar"] == 0.5
    assert np.array_equal(batch.meta_info["nested"][0], fortran)


def test_a_value_shared_many_times_is_charged_each_time_it_is_referenced(tmp_path):
    # 200 references: 13 MB once expanded, under the budget of a small file; 400 are past it,
    # though the file grows by 400 bytes
    assert len(read_gen_batch(written(tmp_path, F.meta(F.shared(SHARED_TEXT, 200)))).meta_info["a"]) == 200
    refusal(read_gen_batch, written(tmp_path, F.meta(F.shared(SHARED_TEXT, 400))), "declares meta_info, its shared")


CHILD = """
import json, resource, sys
from skip_core.cli import cli
from skip_plugin_verl.dumps.tq_pickle import read_tq_batch
from skip_plugin_verl.dumps.verl_pickle import read_gen_batch
read_gen_batch(sys.argv[3])  # every module and lazy import loaded (torch's jagged tensors: 43 MB):
read_tq_batch(sys.argv[4])  # the baseline is the interpreter's
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    cli.main(["cache", "import-verl", sys.argv[1], sys.argv[2], "--trust-pickle"], standalone_mode=False)
    code = 0
except SystemExit as exc:
    code = exc.code
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"above_mb": (peak - base) / 1024, "code": code}))
"""


def test_hostile_imports_stay_small_print_one_line_each_and_never_crash(tmp_path):
    """Every case, ``gen_batch.dp`` and ``tq_batch.pt``, through ``skip cache import-verl
    --trust-pickle`` in a fresh interpreter, with one accepted dump that costs nearly its budget
    (64 KiB shared 200 times): the command exits 1 (no signal killed it), prints one ``error:``
    line per hostile dump and imports the last one, and its peak resident memory stays within
    100 MB of the interpreter's. Measured: 30 MB, the accepted dump's 13 MB entry; each hostile
    case alone under 1 MB, against 2 to 10.8 GB before."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    dumps = [(payload, "gen_batch.dp") for payload, _ in CASES.values()]
    dumps += [(payload, "0/tq_batch.pt") for payload, _ in H.TQ_CASES.values()]
    dumps.append((F.meta(F.shared(SHARED_TEXT, 200)), "gen_batch.dp"))
    for step, (payload, name) in enumerate(dumps):
        path = src / "exp_proj" / "GBS1_N1_in1_out1" / str(step) / name
        path.parent.mkdir(parents=True)
        path.write_bytes(payload)
        (path.parent / "meta.json").write_text(json.dumps({"global_steps": step}))
    (tmp_path / "tq_batch.pt").write_bytes(H.tq_dump())
    command = [sys.executable, "-c", CHILD, str(src), str(dst), str(REAL_DUMP), str(tmp_path / "tq_batch.pt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    errors = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(dumps) - 1, done.stdout[-3000:]
    assert result["code"] == 1 and f"{len(errors)} of {len(dumps)} verl dumps could not be imported" in done.stdout
    assert result["above_mb"] < 100, result
    assert [p.parent.name for p in dst.rglob("tensors.safetensors")] == [str(len(dumps) - 1)]
