"""The hostile ``gen_batch.dp`` files the readers must refuse, and what a refusal must look like.

``CASES`` maps a name to the file's bytes and a pattern its one-line error must match. They are
written opcode by opcode (``pickle_forge``), the way an attacker would, never through the objects
they describe. The cases the security probe reported first (issue 50) and what they cost before
the fix: ``object-over-bytes`` returned ``os.system`` given its address (any other address
crashed the process); ``long-binput`` (40 bytes) took 4 GB; ``reconstruct-objects`` (103 bytes)
5 GB and wrote a 1.6 GB entry; ``doubling`` (359 bytes) 10.8 GB and a 2.4 GB entry; ``stride-0``
(621 bytes) 4 GB and a 2 GB entry; ``zip-size-lie`` (515 bytes) 2 GB; and, found while fixing
those, ``build-on-tensor`` (643 bytes: ``Tensor.__setstate__`` re-pointing a rebuilt tensor) 4.1 GB
and a 2 GB entry.
"""

from __future__ import annotations

import importlib.util
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from skip_core.reading import UnsafeFile
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.restricted_pickle import DTYPES
from torch.nested._internal.nested_tensor import NestedTensor

_spec = importlib.util.spec_from_file_location("pickle_forge", Path(__file__).parent / "pickle_forge.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)

OWN_ERRORS = (UnsafePickleError, VerlDumpError, UnsafeFile)
_NUMPY_SCALARS = {np.dtype(code).type for code in "?bhilqBHILQefdFDSU"}


# -- what a refusal and a result must be -----------------------------------------------------------


def refusal(read, path: Path, message: str) -> str:
    """The error ``read(path)`` raises: the reader's own, on one printable line, matching ``message``."""
    with pytest.raises(OWN_ERRORS) as caught:
        read(path)
    text = str(caught.value)
    assert text.isprintable() and len(text) < 600, text
    assert re.search(message, text), text
    return text


def assert_plain(value, depth: int = 0) -> None:
    """``value`` is made of plain data only: what a dump may hold and a skip entry may store."""
    assert depth < 200
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if isinstance(value, np.generic):
        assert type(value) in _NUMPY_SCALARS, type(value)
    elif type(value) is np.ndarray:
        assert value.dtype.kind in "biufcSUO" and value.dtype.fields is None and value.dtype.subdtype is None
        for item in value.flat if value.dtype.kind == "O" else ():
            assert_plain(item, depth + 1)
    elif type(value) in (list, tuple):
        for item in value:
            assert_plain(item, depth + 1)
    else:
        assert type(value) is dict, type(value)
        for key, item in value.items():
            assert_plain(key, depth + 1)
            assert_plain(item, depth + 1)


def assert_tensor(tensor) -> None:
    """A torch tensor, or a jagged one (verl's V1 trainer's ``prompts``), of a dtype skip stores."""
    assert type(tensor) in (torch.Tensor, NestedTensor) and tensor.dtype in DTYPES.values(), type(tensor)


def assert_plain_batch(batch) -> None:
    for tensor in batch.batch.values():
        assert_tensor(tensor)
    assert_plain(batch.non_tensor_batch)
    assert_plain(batch.meta_info)


# -- the hostile files -------------------------------------------------------------------------------

NONE, EMPTY = [("NONE", None)], [("EMPTY_DICT", None)]
I8 = F.dtype("i8")
OBJECT = F.dtype("O8", "|", flags=63)
NDARRAY = [("GLOBAL", ("numpy", "ndarray"))]


def object_over_bytes(flags: int, address: int = 0x4141414141414141) -> bytes:
    """non_tensor_batch['x'] = ndarray((1,), object, buffer=<8 bytes>): numpy reads them as a pointer."""
    data = [("SHORT_BINBYTES", struct.pack("<Q", address))]
    return F.non_tensor("x", F.array((1,), F.dtype("O8", "|", flags=flags), data))


def lying_length(name: str, length: int) -> bytes:
    """A DataProto whose batch is pushed by ``name`` declaring ``length`` bytes, 3 of them present."""
    op = F.OPCODES[name]
    width = 4 if op.arg.name == "bytes4" else 8
    raw = op.code.encode("latin1") + length.to_bytes(width, "little") + b"abc"
    return F.dataproto(F.dataproto_state([("RAW", raw)], EMPTY))


def in_batch(archive: bytes) -> bytes:
    return F.dataproto(F.dataproto_state([("BINBYTES", archive)], EMPTY))


def strided(numel: int, size: tuple, stride: tuple, offset: int = 0, record_numel: int | None = None) -> bytes:
    """An unconsolidated TensorDict whose one tensor is ``as_strided`` over a storage of ``numel`` int64."""
    tensor = F.tensor(F.storage("0", numel), offset, size, stride)
    record = bytes(8 * (numel if record_numel is None else record_numel))
    return F.batch_archive(F.tensordict({"t": tensor}, [size[0] if size else 1]), {"0": record})


def consolidated(spec: tuple, storage_bytes: int = 64) -> bytes:
    """A consolidated TensorDict whose one leaf is ``spec``: ``(dtype, shape, start, stop, pad)``."""
    metadata = {"cls": "TensorDict", "non_tensors": {}, "leaves": {"t": spec}, "cls_metadata": {"batch_size": [2]}}
    storage = F.tensor(F.storage("0", storage_bytes, "ByteStorage"), 0, (storage_bytes,), (1,))
    call = F.call("tensordict._reductions", "_rebuild_tensordict_files_consolidated", F.push(metadata), storage)
    return F.batch_archive(call, {"0": bytes(storage_bytes)})


def lying_local_header(archive: bytes, name: str = "archive/data/0") -> bytes:
    """``archive`` with the local header of ``name`` declaring 1 GB where the central directory says less."""
    out, at = bytearray(archive), 0
    while (at := out.find(b"PK\x03\x04", at)) >= 0:
        length = struct.unpack_from("<H", out, at + 26)[0]
        if out[at + 30 : at + 30 + length] == name.encode():
            struct.pack_into("<II", out, at + 18, 1 << 30, 1 << 30)
        at += 4
    return bytes(out)


def _one_byte_tensor(numel: int, record: bytes) -> bytes:
    return F.torch_archive(F.tensor(F.storage("0", numel, "ByteStorage"), 0, (1,), (1,)), {"0": record})


def built(ops: list, attribute: str, value: list | None = None) -> list:
    """``ops`` followed by a BUILD setting ``attribute`` through the (dict, slots) form of its state."""
    slots = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", attribute), *(value or NONE), ("SETITEM", None)]
    return [*ops, ("NONE", None), *slots, ("TUPLE2", None), ("BUILD", None)]


def repointed_tensor(numel: int) -> bytes:
    """A tensor BUILT with the state ``(itself, 0, (numel,), (0,))``: ``Tensor.__setstate__`` would
    ``set_`` it to ``numel`` elements of stride 0 over its one-element storage, past every check."""
    tensor = [*F.tensor(F.storage("0", 1), 0, (1,), (1,)), ("BINPUT", 0)]
    state = [("MARK", None), ("BINGET", 0), ("BININT1", 0), *F.push((numel,)), *F.push((0,)), ("TUPLE", None)]
    return F.batch_archive(F.tensordict({"t": [*tensor, *state, ("BUILD", None)]}, [numel]), {"0": bytes(8)})


_FIELDS = [("NONE", None), *F.push(("a",)), ("EMPTY_DICT", None)]  # (subarray, names, fields) of a record
_EMPTY_ARRAY = F.call(F.NUMPY, "_reconstruct", NDARRAY, F.push((0,)), [("SHORT_BINBYTES", b"b")])
_FROMBUFFER = ("numpy._core.numeric", "_frombuffer")

CASES: dict[str, tuple[bytes, str]] = {
    # numpy: object data only from a list of plain values, never from bytes
    "object-over-bytes": (object_over_bytes(0), r"numpy object array of shape \(1,\) whose values are not a list"),
    "object-over-bytes-flags": (object_over_bytes(63), "whose values are not a list of that many"),
    "object-values-short": (F.non_tensor("x", F.array((3,), OBJECT, F.push(["a"]))), "not a list of that many"),
    "frombuffer-objects": (
        F.meta(F.call(*_FROMBUFFER, F.push(bytes(8)), OBJECT, F.push((1,)), F.push("C"))),
        "refusing numpy object data given as raw bytes",
    ),
    "scalar-object": (F.meta(F.scalar(OBJECT, bytes(8))), "refusing numpy object data given as raw bytes"),
    "structured-object-field": (
        F.non_tensor("x", F.array((1,), F.dtype("V8", "|", 8, 63, _FIELDS), F.push(bytes(8)))),
        "refusing numpy dtype 'V8'",
    ),
    "fields-on-a-number": (F.meta(F.scalar(F.dtype("u1", "|", extra=_FIELDS), b"\0")), "with a subarray or fields"),
    "object-with-fields": (F.meta(F.scalar(F.dtype("O8", "|", flags=63, extra=_FIELDS), bytes(8))), "or fields"),
    "subarray": (F.meta(F.scalar(F.dtype("i8", extra=[*F.push((1, 2)), *NONE, *NONE]), bytes(8))), "a subarray"),
    "dtype-state-twice": (F.meta([*I8, *F.dtype_state(flags=63)]), "second state for numpy dtype"),
    "dtype-without-state": (F.meta(F.scalar(F.call("numpy", "dtype", F.push("i8")), bytes(8))), "before its state"),
    "dtype-itemsize-lie": (F.meta(F.scalar(F.dtype("U5", elsize=4000), bytes(20))), "declaring items of 4000 bytes"),
    "dtype-datetime": (F.meta(F.scalar(F.dtype("M8"), bytes(8))), "refusing numpy dtype 'M8'"),
    "dtype-huge-unicode": (F.meta(F.scalar(F.dtype("U268435456"), bytes(4))), "refusing numpy dtype 'U268435456'"),
    "dtype-of-int": (F.meta(F.call("numpy", "dtype", F.push(7))), "refusing numpy dtype 7"),
    "unicode-past-unicode": (
        F.non_tensor("x", F.array((1,), F.dtype("U1"), F.push(b"\xff\xff\xff\xff"))),
        r"characters past U\+10FFFF",
    ),
    "shape-beyond-data": (F.non_tensor("x", F.array((10**9,), I8, F.push(bytes(8)))), "given 8 bytes, not 8000000000"),
    "scalar-short": (F.meta(F.scalar(I8, bytes(3))), "given 3 bytes, not 8"),
    "frombuffer-order": (
        F.meta(F.call(*_FROMBUFFER, F.push(bytes(8)), I8, F.push((1,)), F.push("K"))),
        "refusing numpy array order 'K'",
    ),
    "reconstruct-objects": (
        F.non_tensor("x", F.call(F.NUMPY, "_reconstruct", NDARRAY, F.push((1 << 28,)), F.push(b"O"))),
        "numpy only reconstructs an empty array",
    ),
    "ndarray-newobj": (F.meta([*NDARRAY, ("EMPTY_TUPLE", None), ("NEWOBJ", None)]), "refusing to instantiate"),
    "array-state-twice": (
        F.non_tensor(
            "x", [*F.array((1,), I8, F.push(bytes(8))), *F.push((1, (1,), None, False, b"")), ("BUILD", None)]
        ),
        "second state for a numpy array",
    ),
    "array-without-state": (F.non_tensor("x", _EMPTY_ARRAY), "numpy array without its state"),
    # pickle's own sizes against the file's
    "long-binput": (
        F.dataproto(F.dataproto_state(NONE, [*EMPTY, ("LONG_BINPUT", 1 << 28)])),
        r"LONG_BINPUT at byte \d+ declares memo slot 268435456",
    ),
    "put-text": (
        F.dataproto(F.dataproto_state(NONE, [*EMPTY, ("PUT", 10**12)])),
        r"PUT at byte \d+ declares memo slot 1000000000000",
    ),
    "binbytes8": (lying_length("BINBYTES8", 1 << 40), r"BINBYTES8 at byte \d+ declares 1099511627776 bytes, past the"),
    "binunicode8": (lying_length("BINUNICODE8", 1 << 40), r"BINUNICODE8 at byte \d+ declares 1099511627776 bytes"),
    "binbytes": (lying_length("BINBYTES", 1 << 31), r"BINBYTES at byte \d+ declares 2147483648 bytes"),
    "frame": (
        b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + F.dataproto(F.dataproto_state(NONE, EMPTY))[2:],
        "FRAME at byte 2 declares 1099511627776 bytes",
    ),
    "no-stop": (F.dataproto(F.dataproto_state(NONE, EMPTY))[:-1], "ends without pickle's STOP"),
    "not-an-opcode": (b"\x80\x04\xff.", "has no pickle opcode at byte 2"),
    "after-stop": (
        F.dataproto(F.dataproto_state(NONE, EMPTY)) + bytes(1 << 16),
        r"holds 65536 bytes after its pickle's end",
    ),
    "out-of-band-buffer": (F.dataproto(F.dataproto_state([("NEXT_BUFFER", None)], EMPTY)), "UnpicklingError"),
    "extension-code": (F.dataproto(F.dataproto_state([("EXT1", 1)], EMPTY)), "does not unpickle: ValueError"),
    # values that expand once written out (memo fan-out), contain themselves, nest, or are not plain
    "doubling": (F.meta(F.doubling(25)), r"declares meta_info, its shared values counted each time, .* allowed"),
    "fan-out": (F.meta(F.shared([("BINUNICODE", "x" * 4096)], 5000)), "declares meta_info, its shared values"),
    "cycle": (
        F.meta([("EMPTY_LIST", None), ("BINPUT", 0), ("BINGET", 0), ("APPEND", None)]),
        r"meta_info\['a'\]\[0\]: contains itself",
    ),
    "deep": (
        F.meta([("MARK", None)] * 1000 + [("LIST", None)] * 1000),
        r"meta_info\['a'\]\[0\]\[0\]\[0\]\.\.\.93 levels\.\.\.\[0\]\[0\]\[0\]: is nested more than 100 levels deep",
    ),
    "set-value": (F.meta([("EMPTY_SET", None)]), "holds a set, which a skip entry cannot store"),
    "bytearray-value": (F.meta([("BYTEARRAY8", b"ab")]), "holds a bytearray"),
    "size-value": (F.meta(F.call("torch", "Size", F.push([1]))), "holds a Size"),
    "class-value": (F.meta([("GLOBAL", ("verl.protocol", "DataProto"))]), "holds the global <_DataProtoState>"),
    "dataproto-state-twice": (
        F.dataproto([*F.dataproto_state(NONE, EMPTY), ("BUILD", None), *F.dataproto_state(NONE, EMPTY)]),
        "second state for DataProto",
    ),
    # REDUCE on allowed callables with hostile arguments
    "size-of-strings": (F.meta(F.call("torch", "Size", F.push(["a"]))), r"torch.Size is \['a'\], not a list"),
    "size-negative": (F.meta(F.call("torch", "Size", F.push([-1]))), "not a list of at most 64 non-negative"),
    "ordered-dict-args": (F.meta(F.call("collections", "OrderedDict", F.push([(1, 2)]))), "TypeError"),
    "scalar-of-a-name": (F.meta(F.scalar(F.push("i8"), bytes(8))), "with dtype 'i8', which is not a numpy dtype"),
    "frombuffer-of-a-list": (
        F.meta(F.call(*_FROMBUFFER, F.push([0] * 8), I8, F.push((1,)), F.push("C"))),
        r"given \[0, 0, 0, 0, \.\.\.\] bytes, not 8",
    ),
    "reconstruct-another-class": (
        F.meta(
            F.call(F.NUMPY, "_reconstruct", [("GLOBAL", ("verl.protocol", "DataProto"))], F.push((0,)), F.push(b"b"))
        ),
        r"refusing numpy _reconstruct\(<_DataProtoState>, \(0,\), b'b'\)",
    ),
    "dataproto-args": (
        F.assemble([("GLOBAL", ("verl.protocol", "DataProto")), *F.push((1,)), ("NEWOBJ", None), ("STOP", None)]),
        "does not unpickle: TypeError",
    ),
    # torch.save archives: tensors within their storage, records within the archive
    "stride-0": (
        strided(1, (1 << 28,), (0,)),
        r"a tensor of shape \(268435456,\), strides \(0,\) and offset 0 addresses more than its 1-element storage",
    ),
    "strides-overlap": (strided(4, (4, 4), (1, 1)), r"shape \(4, 4\), strides \(1, 1\) .* 4-element storage"),
    "offset-past-storage": (strided(4, (2,), (1,), offset=3), "offset 3 addresses more than its 4-element storage"),
    "shape-stride-mismatch": (strided(4, (2, 2), (1,)), r"a tensor of shape \(2, 2\) with strides \(1,\)"),
    "negative-stride": (strided(4, (2,), (-1,)), r"tensor strides is \(-1,\), not a list"),
    "storage-numel-lie": (
        strided(1 << 40, (1,), (1,), record_numel=1),
        "storage record archive/data/0 has 8 bytes, expected 8796093022208",
    ),
    "zip-size-lie": (
        in_batch(F.central_sizes(_one_byte_tensor(1 << 28, b"\x07"), "archive/data/0", 1 << 28)),
        r"record archive/data/0 declares 268435456 bytes at byte \d+ \(local header: 1\), which its \d+-byte",
    ),
    "local-header-lie": (
        in_batch(lying_local_header(_one_byte_tensor(1, b"\x07"))),
        r"record archive/data/0 declares 1 bytes .*\(local header: 1073741824\)",
    ),
    "leaf-past-storage": (consolidated(("torch.int64", [2], 0, 640, 0)), "does not fit bytes 0:640 of its 64-byte"),
    "leaf-beyond-slice": (consolidated(("torch.int64", [1 << 30], 0, 16, 0)), r"\(8589934592 bytes\) does not fit"),
    "leaf-dtype": (consolidated(("torch.object", [2], 0, 16, 0)), r"batch\['t'\]: bad consolidated leaf"),
    "rebuild-v3-dtype": (
        F.batch_archive(
            F.call(
                "torch._utils",
                "_rebuild_tensor_v3",
                F.storage("0", 1),
                *(F.push(a) for a in (0, (1,), (1,), False)),
                EMPTY,
                F.push("float32"),
            ),
            {"0": bytes(8)},
        ),
        "tensor rebuilt as 'float32', which is not a torch dtype",
    ),
    "consolidated-metadata": (
        F.batch_archive(
            F.call(
                "tensordict._reductions",
                "_rebuild_tensordict_files_consolidated",
                F.push([1]),
                F.tensor(F.storage("0", 8, "ByteStorage"), 0, (8,), (1,)),
            ),
            {"0": bytes(8)},
        ),
        "consolidated TensorDict without metadata",
    ),
    "make-td-class": (
        F.batch_archive(F.call("tensordict._reductions", "_make_td", [("GLOBAL", ("torch", "Size"))], EMPTY), {}),
        "unexpected TensorDict reduction",
    ),
    "rebuild-from-non-storage": (
        F.batch_archive(
            F.call("torch._utils", "_rebuild_tensor_v2", NONE, *(F.push(a) for a in (0, (1,), (1,))), NONE, EMPTY), {}
        ),
        "tensor rebuilt from something that is not a storage",
    ),
    "device-index": (F.batch_archive(F.call("torch", "device", F.push("cpu"), F.push(-5)), {}), "RuntimeError"),
    "persistent-id": (
        F.batch_archive([*F.push("storage"), ("BINPERSID", None)], {}),
        "refusing persistent id 'storage'",
    ),
    # BUILD on what the stand-ins hand to the pickle: none is a plain object whose attributes it sets
    "build-on-tensor": (repointed_tensor(1 << 28), r"does not unpickle: UnpicklingError: state is not a dictionary"),
    "build-on-tensor-slots": (
        F.batch_archive(built(F.tensor(F.storage("0", 1), 0, (1,), (1,)), "tensor"), {"0": bytes(8)}),
        "refusing to set 'tensor' on PickledTensor",
    ),
    "build-on-storage": (F.batch_archive(built(F.storage("0", 1), "data"), {"0": bytes(8)}), "'data' on _Storage"),
    "build-on-tensordict": (
        F.batch_archive(built(F.tensordict({}, [1]), "tensors"), {}),
        "refusing to set 'tensors' on TensorDictData",
    ),
    "build-on-scalar": (F.meta(built(F.scalar(I8, bytes(8)), "value")), "refusing to set 'value' on PickledScalar"),
    "build-on-size": (F.meta(built(F.call("torch", "Size", F.push([1])), "x")), "AttributeError"),
    "archive-empty": (in_batch(b"PK\x05\x06" + bytes(18)), r"is not a torch.save archive \(data.pkl records: \[\]\)"),
    "archive-directory-past-end": (
        in_batch(b"PK\x05\x06" + struct.pack("<4H2IH", 0, 0, 1, 1, 46, 1 << 20, 0)),
        "is not a torch zip archive .*: BadZipFile",
    ),
}


# -- verl's V1 trainer's tq_batch.pt ----------------------------------------------------------------

_NJT = "torch.nested._internal.nested_tensor"
# The storage records of ``tq_payload``: 5 jagged values, their offsets, 2 x 4 responses (int64).
TQ_RECORDS = {"0": bytes(40), "1": struct.pack("<3q", 0, 2, 5), "2": bytes(64)}
_NEW_NON_TENSOR_DATA = [
    ("GLOBAL", ("tensordict.tensorclass", "NonTensorData")),
    ("EMPTY_TUPLE", None),
    ("NEWOBJ", None),
]


def non_tensor_data(data, pushed: list | None = None) -> list:
    """A ``NonTensorData`` holding ``data`` (or what the ops ``pushed`` push), as tensordict pickles
    one: NEWOBJ, then BUILD with its state."""
    value = [*F.push("data"), *(F.push(data) if pushed is None else pushed), ("SETITEM", None)]
    state = [("EMPTY_DICT", None), *F.push("non_tensordict"), ("EMPTY_DICT", None), *value, ("SETITEM", None)]
    return [*_NEW_NON_TENSOR_DATA, *state, ("BUILD", None)]


def non_tensor_stack(values: list) -> list:
    """A ``NonTensorStack`` of one ``NonTensorData`` per value, through tensordict's ``_make_td``."""
    items = [op for value in values for op in [*non_tensor_data(value), ("APPEND", None)]]
    state = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "tensordicts"), ("EMPTY_LIST", None), *items, ("SETITEM", None)]
    stack = [("GLOBAL", ("tensordict.tensorclass", "NonTensorStack"))]
    return F.call("tensordict._reductions", "_make_td", stack, state)


def jagged(offsets_key: str = "1", rebuild: tuple[str, str] = (_NJT, "_rebuild_njt")) -> list:
    """A jagged tensor as torch pickles one: ``_rebuild_from_type_v2(_rebuild_njt, NestedTensor, ...)``."""
    values, offsets = F.tensor(F.storage("0", 5), 0, (5,), (1,)), F.tensor(F.storage(offsets_key, 3), 0, (3,), (1,))
    parts = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "values"), *values, ("SETITEM", None)]
    parts += [("SHORT_BINUNICODE", "offsets"), *offsets, ("SETITEM", None), ("TUPLE1", None)]
    kind = [("GLOBAL", rebuild)], [("GLOBAL", (_NJT, "NestedTensor"))]
    return F.call("torch._tensor", "_rebuild_from_type_v2", *kind, parts, [("EMPTY_DICT", None)])


def tq_payload(fields: dict | None = None, keys: list | None = None) -> list:
    """The ``torch.save`` payload of ``RolloutTqSkip.prepare_data`` (over ``TQ_RECORDS``): two
    trajectories with a tensor, a jagged tensor, one text per row and one value for all; ``fields``
    are added to (or replace) those."""
    base = {
        "responses": F.tensor(F.storage("2", 8), 0, (2, 4), (4, 1)),
        "prompts": jagged(),
        "text": non_tensor_stack(["text 0", "text 1"]),
        "validate": non_tensor_data({"temperature": 1.0}),
    }
    payload = {"keys": ["k0", "k1"] if keys is None else keys, "tags": [{"status": "ok"}, {}], "global_steps": 3}
    ops = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "tensordict"), *F.tensordict({**base, **(fields or {})}, [2])]
    ops.append(("SETITEM", None))
    return ops + [op for key, value in payload.items() for op in [*F.push(key), *F.push(value), ("SETITEM", None)]]


def tq_dump(fields: dict | None = None, keys: list | None = None, records: dict | None = None) -> bytes:
    return F.torch_archive(tq_payload(fields, keys), {**TQ_RECORDS, **(records or {})})


TQ_CASES: dict[str, tuple[bytes, str]] = {
    "tq-field-named-as-a-column": (
        tq_dump({"__tq_key__": non_tensor_data(1)}),
        "ValueError: a TransferQueue field is named '__tq_key__', which skip uses for its own column",
    ),
    "tq-rows": (
        tq_dump({"responses": F.tensor(F.storage("2", 8), 0, (4, 2), (2, 1))}),
        "field 'responses' has 4 rows, the dump has 2 keys",
    ),
    "tq-offsets": (tq_dump({"prompts": jagged("3")}, records={"3": struct.pack("<3q", 0, 3, 2)}), "do not split"),
    "tq-rebuild-through": (
        tq_dump({"prompts": jagged(rebuild=("tensordict._reductions", "_make_td"))}),
        "unexpected tensor rebuild through <_make_td>",
    ),
    "tq-stack-rows": (tq_dump({"text": non_tensor_stack(["only one"])}), "is not a stack of 2 non-tensor values"),
    "tq-keys": (tq_dump(keys=[1, 2]), "keys that are not strings"),
    "tq-value-without-data": (
        tq_dump({"validate": [*_NEW_NON_TENSOR_DATA, *F.push({"non_tensordict": {}}), ("BUILD", None)]}),
        "a non-tensor value without its data",
    ),
    "tq-tensor-in-values": (
        tq_dump({"validate": non_tensor_data(None, F.tensor(F.storage("2", 8), 0, (8,), (1,)))}),
        r"field 'validate': holds a torch tensor, which a skip entry cannot store as data",
    ),
    "tq-not-a-dict": (F.torch_archive(F.push([1]), {}), "is not verl's rollout_tq dump"),
    "tq-set-of-lists": (F.torch_archive(F.call("builtins", "set", F.push([[1]])), {}), "TypeError: unhashable"),
    "tq-latin1": (
        F.torch_archive(F.call("_codecs", "encode", F.push("x"), F.push("utf-8")), {}),
        "unexpected bytes encoding 'utf-8'",
    ),
}
