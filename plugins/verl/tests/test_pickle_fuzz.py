"""The readers fuzzed over their opcode streams (hypothesis): whatever the pickle, a reader returns
plain data or raises one of its own errors on one line; nothing else, and never a crash.

The streams are verl's own dumps (tests/data/verl) with opcodes deleted, repeated, moved,
replaced and inserted, at the DataProto's level and inside the ``torch.save`` archive of its
batch; small generated streams placed where verl puts ``meta_info``; and a ``tq_batch.pt`` shaped
as verl's V1 trainer writes one (a TensorDict of a tensor, a jagged tensor and non-tensor values),
mutated likewise. The examples are derandomized (the same ones on every run, so a failure is
reproduced by rerunning) and few enough for the module to take seconds.
"""

from __future__ import annotations

import importlib.util
import io
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from skip_plugin_verl.dumps.tq_pickle import TqDump, _TqUnpickler, decode_tq_batch, read_tq_batch
from skip_plugin_verl.dumps.verl_pickle import _OuterUnpickler, read_gen_batch

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("hostile_cases", HERE / "hostile_cases.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)
F = H.F
DUMPS = {path.parts[-5] + "/" + path.parts[-2]: path for path in sorted((HERE / "data/verl").rglob("gen_batch.dp"))}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,  # nothing written outside tmp_path
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- what a generated opcode may be ------------------------------------------------------------------

_FORBIDDEN = [("os", "system"), ("builtins", "eval"), ("numpy", "frombuffer"), ("torch", "load")]
_GLOBALS = sorted({*_OuterUnpickler.allowed, *_TqUnpickler.allowed}) + _FORBIDDEN
_BARE = [op.name for op in F.OPCODES.values() if op.arg is None and op.name not in ("STOP", "PROTO")]
_SIZES = st.sampled_from([0, 1, 7, 255, 1 << 16, 1 << 31, (1 << 40) + 3, (1 << 64) - 1])
OPS = st.one_of(
    st.tuples(st.sampled_from(_BARE), st.none()),
    st.tuples(st.just("BININT1"), st.integers(0, 255)),
    st.tuples(st.just("BININT"), st.integers(-(1 << 31), (1 << 31) - 1)),
    st.tuples(st.just("LONG1"), st.integers(-(1 << 100), 1 << 100)),
    st.tuples(st.just("BINFLOAT"), st.floats(allow_nan=True)),
    st.tuples(st.sampled_from(["SHORT_BINUNICODE", "BINUNICODE"]), st.text(max_size=12)),
    st.tuples(st.sampled_from(["SHORT_BINBYTES", "BINBYTES"]), st.binary(max_size=24)),
    st.tuples(st.sampled_from(["BINGET", "BINPUT"]), st.integers(0, 255)),
    st.tuples(st.sampled_from(["LONG_BINGET", "LONG_BINPUT"]), st.integers(0, (1 << 32) - 1)),
    st.tuples(st.just("GLOBAL"), st.sampled_from(_GLOBALS)),
    st.builds(  # a length that lies: the opcode, the declared size, a few bytes
        lambda code, size: ("RAW", code + size.to_bytes(8, "little")[: 4 if code in b"BX" else 8] + b"xyz"),
        st.sampled_from([b"\x8e", b"\x8d", b"\x96", b"\x95", b"B", b"X"]),
        _SIZES,
    ),
)
KINDS = ["delete", "repeat", "move", "replace", "insert", "splice"]
EDITS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0), st.integers(0), OPS), min_size=1, max_size=6)


def mutated(ops: list, edits: list) -> list:
    """``ops`` with each edit applied at a position (taken modulo its length); a splice inserts a
    run of another stream's ops (``DONORS``: verl's pickles, the archive's, the tq dump's)."""
    ops = list(ops)
    for kind, at, number, new in edits:
        at, other = at % len(ops), number % len(ops)
        if kind == "splice":
            donor = DONORS[number % len(DONORS)]
            start = number // len(DONORS) % len(donor)
            ops[at:at] = donor[start : start + 1 + number % 16]
        elif kind == "delete":
            del ops[at : at + 1 + other % 4]
        elif kind == "repeat":
            ops[at:at] = ops[at : at + 1 + other % 8] * (1 + other % 3)
        elif kind == "move":
            ops.insert(other, ops.pop(at))
        elif kind == "replace":
            ops[at] = new
        else:
            ops.insert(at, new)
        if not ops:
            ops = [("STOP", None)]
    return ops


def renumbered(ops: list) -> list:
    """``ops`` with their memo slots numbered in order again, as a pickler writes them (and each GET
    pointed at its slot's new number): past the reader's check of memo slots, to what follows."""
    slots: dict = {}
    out = []
    for name, arg in ops:
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            slots[arg] = len(slots)
            out.append(("LONG_BINPUT", slots[arg]))
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            out.append(("LONG_BINGET", slots.get(arg, arg)))
        else:
            out.append((name, arg))
    return out


def unframed(data: bytes) -> list:
    """The ops of a pickle without its FRAME opcodes: frames are optional, and an edit would make
    their lengths lie (refused before anything else is read: a fuzzer that never gets past them)."""
    return [op for op in F.disassemble(data) if op[0] != "FRAME"]


def read_outcome(read, path: Path) -> None:
    """``read(path)`` returns plain data, or raises the reader's own error on one line."""
    try:
        result = read(path)
    except H.OWN_ERRORS as exc:
        text = str(exc)
        assert text.isprintable() and len(text) < 600, text
        return
    if isinstance(result, TqDump):
        for tensor in result.tensors.values():
            H.assert_tensor(tensor)
        H.assert_plain([result.stacks, result.singles, result.keys, result.tags, result.step])
        return
    if isinstance(result, tuple):  # read_tq_batch: the batch and its step
        result, step = result
        assert type(step) is int
    H.assert_plain_batch(result)


# -- the DataProto pickle ----------------------------------------------------------------------------


@FUZZ
@given(st.sampled_from(sorted(DUMPS)), EDITS)
def test_mutated_real_dumps(tmp_path, dump, edits):
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(F.assemble(mutated(unframed(DUMPS[dump].read_bytes()), edits)))
    read_outcome(read_gen_batch, path)


@FUZZ
@given(st.lists(OPS, max_size=24))
def test_generated_meta_info(tmp_path, ops):
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(F.meta(ops))
    read_outcome(read_gen_batch, path)


def _archive_of(outer: list) -> tuple[int, zipfile.ZipFile]:
    at = next(i for i, (name, arg) in enumerate(outer) if name == "BINBYTES" and arg[:2] == b"PK")
    return at, zipfile.ZipFile(io.BytesIO(outer[at][1]))


def rezipped(archive: zipfile.ZipFile, data_pkl: bytes) -> bytes:
    records = {info.filename: archive.read(info) for info in archive.infolist()}
    return F.zip_archive({**records, "archive/data.pkl": data_pkl})


DEFAULT = unframed(DUMPS["dump_default/1"].read_bytes())
AT, ARCHIVE = _archive_of(DEFAULT)
DATA_PKL = F.disassemble(ARCHIVE.read("archive/data.pkl"))


@FUZZ
@given(EDITS, st.booleans())
def test_mutated_batch_archive(tmp_path, edits, consistent_memo):
    ops = mutated(DATA_PKL, edits)
    outer = list(DEFAULT)
    outer[AT] = ("BINBYTES", rezipped(ARCHIVE, F.assemble(renumbered(ops) if consistent_memo else ops)))
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(F.assemble(outer))
    read_outcome(read_gen_batch, path)


# -- verl's V1 trainer's tq_batch.pt -------------------------------------------------------------


TQ_PKL, TQ_RECORDS = H.tq_payload(), H.TQ_RECORDS
DONORS = [*(unframed(path.read_bytes()) for path in DUMPS.values()), DATA_PKL, TQ_PKL]


def test_the_tq_base_is_read_as_verl_wrote_it(tmp_path):
    path = tmp_path / "tq_batch.pt"
    path.write_bytes(F.torch_archive(TQ_PKL, TQ_RECORDS))
    dump = decode_tq_batch(path)
    assert dump.keys == ["k0", "k1"] and dump.step == 3 and dump.singles == {"validate": {"temperature": 1.0}}
    assert dump.stacks == {"text": ["text 0", "text 1"]} and dump.tensors["prompts"].is_nested
    batch, step = read_tq_batch(path)
    assert step == 3 and list(batch.non_tensor_batch["text"]) == ["text 0", "text 1"]
    assert [len(row) for row in batch.batch["prompts"].unbind()] == [2, 3]


@pytest.mark.parametrize("read", [decode_tq_batch, read_tq_batch])
@FUZZ
@given(edits=EDITS, consistent_memo=st.booleans())
def test_mutated_tq_dumps(tmp_path, read, edits, consistent_memo):
    ops = mutated(TQ_PKL, edits)
    path = tmp_path / "tq_batch.pt"
    path.write_bytes(F.torch_archive(renumbered(ops) if consistent_memo else ops, TQ_RECORDS))
    read_outcome(read, path)


@FUZZ
@given(st.lists(st.tuples(st.integers(0), st.integers(0, 255)), min_size=1, max_size=8))
def test_tq_archives_with_bytes_overwritten(tmp_path, flips):
    """The zip around the pickle: its directory's sizes, offsets and names overwritten at random."""
    archive = bytearray(F.torch_archive(TQ_PKL, TQ_RECORDS))
    for at, byte in flips:
        archive[at % len(archive)] = byte
    path = tmp_path / "tq_batch.pt"
    path.write_bytes(archive)
    read_outcome(read_tq_batch, path)
