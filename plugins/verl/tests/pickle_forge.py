"""Pickles written opcode by opcode, for the hostile-pickle tests and the fuzzer.

``assemble`` turns a list of ``(opcode name, argument)`` pairs into a pickle, whatever the
pairs say (a memo index past the end, a length that lies is written with ``RAW``);
``disassemble`` is its inverse on a well-formed pickle. Loaded by the tests with
``importlib`` (pytest's import mode keeps test directories off ``sys.path``).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import sys
import zipfile
from collections.abc import Iterable, Sequence
from typing import Any

RAW = "RAW"  # not an opcode: its argument (bytes) is written as it is
OPCODES = {op.name: op for op in pickletools.opcodes}
Op = tuple[str, Any]


def _long(value: int) -> bytes:
    """Two's complement, little-endian, as LONG1/LONG4 store an int."""
    return pickle.encode_long(value)


def _counted(fmt: str, data: bytes) -> bytes:
    return struct.pack(fmt, len(data)) + data


_WRITERS = {
    "uint1": lambda a: struct.pack("<B", a),
    "uint2": lambda a: struct.pack("<H", a),
    "int4": lambda a: struct.pack("<i", a),
    "uint4": lambda a: struct.pack("<I", a),
    "uint8": lambda a: struct.pack("<Q", a),
    "float8": lambda a: struct.pack(">d", a),
    "decimalnl_short": lambda a: b"%d\n" % a,
    "decimalnl_long": lambda a: b"%dL\n" % a,
    "floatnl": lambda a: repr(float(a)).encode() + b"\n",
    "stringnl": lambda a: repr(a).encode("ascii", "backslashreplace") + b"\n",
    "stringnl_noescape": lambda a: a.encode() + b"\n",
    "stringnl_noescape_pair": lambda a: "\n".join([*(a.split(" ") if isinstance(a, str) else a), ""]).encode(),
    "long1": lambda a: _counted("<B", _long(a)),
    "long4": lambda a: _counted("<i", _long(a)),
    "string1": lambda a: _counted("<B", a.encode("latin1") if isinstance(a, str) else a),
    "string4": lambda a: _counted("<i", a.encode("latin1") if isinstance(a, str) else a),
    "bytes1": lambda a: _counted("<B", a),
    "bytes4": lambda a: _counted("<I", a),
    "bytes8": lambda a: _counted("<Q", a),
    "bytearray8": lambda a: _counted("<Q", bytes(a)),
    "unicodestringnl": lambda a: a.encode("raw-unicode-escape") + b"\n",
    "unicodestring1": lambda a: _counted("<B", a.encode("utf-8", "surrogatepass")),
    "unicodestring4": lambda a: _counted("<I", a.encode("utf-8", "surrogatepass")),
    "unicodestring8": lambda a: _counted("<Q", a.encode("utf-8", "surrogatepass")),
}


def assemble(ops: Iterable[Op]) -> bytes:
    """The pickle of ``ops``; an argument that its opcode cannot hold raises ``struct.error``/``ValueError``."""
    out = bytearray()
    for name, arg in ops:
        if name == RAW:
            out += arg
            continue
        op = OPCODES[name]
        out += op.code.encode("latin1")
        if op.arg is not None:
            out += _WRITERS[op.arg.name](arg)
    return bytes(out)


def disassemble(data: bytes) -> list[Op]:
    """The ``(opcode name, argument)`` pairs of a well-formed pickle, STOP included (a GLOBAL's
    argument as pickletools gives it, ``"module name"``, which ``assemble`` takes too)."""
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data)]


def call(module: str, name: str, *args: Sequence[Op]) -> list[Op]:
    """``module.name(*args)`` where each argument is given as the ops that push it."""
    return [
        ("GLOBAL", (module, name)),
        ("MARK", None),
        *(op for arg in args for op in arg),
        ("TUPLE", None),
        ("REDUCE", None),
    ]


def push(value: Any) -> list[Op]:
    """The ops that push a plain ``value`` (as protocol 3 writes it), without PROTO or STOP."""
    ops = disassemble(pickle.dumps(value, protocol=3))
    return [op for op in ops if op[0] not in ("PROTO", "STOP") and not op[0].endswith("PUT")]


def dataproto(state: Sequence[Op]) -> bytes:
    """verl's ``pickle.dump(DataProto)`` whose state ``(batch, non_tensor_batch, meta_info)`` the ops push."""
    header = [("PROTO", 4), ("GLOBAL", ("verl.protocol", "DataProto")), ("EMPTY_TUPLE", None), ("NEWOBJ", None)]
    return assemble([*header, *state, ("BUILD", None), ("STOP", None)])


def dataproto_state(batch: Sequence[Op], non_tensors: Sequence[Op], meta: Sequence[Op] | None = None) -> list[Op]:
    return [*batch, *non_tensors, *(meta if meta is not None else [("EMPTY_DICT", None)]), ("TUPLE3", None)]


def zip_archive(members: dict[str, bytes]) -> bytes:
    """A ``torch.save``-shaped zip archive (stored, uncompressed) of ``members``."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


# -- numpy's and torch's reductions, as their picklers write them ----------------------------------

NUMPY = "numpy._core.multiarray"


def dtype_state(order: str = "<", elsize: int = -1, flags: int = 0, extra: Sequence[Op] | None = None) -> list[Op]:
    """BUILD of a dtype with ``(3, order, subarray, names, fields, elsize, -1, flags)``; ``extra``
    replaces ``(subarray, names, fields)`` (three NONEs by default)."""
    middle = extra if extra is not None else [("NONE", None)] * 3
    state = [("MARK", None), ("BININT1", 3), ("SHORT_BINUNICODE", order), *middle]
    return [*state, ("BININT", elsize), ("BININT", -1), ("BININT", flags), ("TUPLE", None), ("BUILD", None)]


def dtype(name: str, order: str = "<", elsize: int = -1, flags: int = 0, extra: Sequence[Op] | None = None) -> list[Op]:
    """``numpy.dtype(name, False, True)`` then BUILD with its state (``dtype_state``)."""
    start = call("numpy", "dtype", [("SHORT_BINUNICODE", name)], [("NEWFALSE", None)], [("NEWTRUE", None)])
    return start + dtype_state(order, elsize, flags, extra)


def array(shape: tuple, dtype_ops: Sequence[Op], data: Sequence[Op], fortran: bool = False) -> list[Op]:
    """An array as numpy pickles it: ``_reconstruct(ndarray, (0,), b'b')`` then BUILD
    ``(1, shape, dtype, fortran, data)``, ``data`` being the ops that push bytes or a list."""
    start = call(NUMPY, "_reconstruct", [("GLOBAL", ("numpy", "ndarray"))], push((0,)), [("SHORT_BINBYTES", b"b")])
    order = ("NEWTRUE", None) if fortran else ("NEWFALSE", None)
    state = [("MARK", None), ("BININT1", 1), *push(shape), *dtype_ops, order, *data, ("TUPLE", None), ("BUILD", None)]
    return start + state


def scalar(dtype_ops: Sequence[Op], data: bytes) -> list[Op]:
    return call(NUMPY, "scalar", dtype_ops, [("SHORT_BINBYTES", data)])


def non_tensor(key: str, value: Sequence[Op]) -> bytes:
    """A DataProto without tensors whose ``non_tensor_batch[key]`` the ops push."""
    items = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", key), *value, ("SETITEM", None)]
    return dataproto(dataproto_state([("NONE", None)], items))


def meta(value: Sequence[Op]) -> bytes:
    """A DataProto without tensors whose ``meta_info['a']`` the ops push."""
    items = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "a"), *value, ("SETITEM", None)]
    return dataproto(dataproto_state([("NONE", None)], [("EMPTY_DICT", None)], items))


def storage(key: str, numel: int, kind: str = "LongStorage") -> list[Op]:
    """torch.save's persistent reference to the storage record ``data/{key}``."""
    pid = [("SHORT_BINUNICODE", "storage"), ("GLOBAL", ("torch", kind)), ("SHORT_BINUNICODE", key)]
    return [("MARK", None), *pid, ("SHORT_BINUNICODE", "cpu"), ("LONG4", numel), ("TUPLE", None), ("BINPERSID", None)]


def tensor(storage_ops: Sequence[Op], offset: int, size: tuple, stride: tuple) -> list[Op]:
    """``torch._utils._rebuild_tensor_v2`` of a storage, as torch.save writes a tensor."""
    hooks = call("collections", "OrderedDict")
    args = (storage_ops, [("LONG4", offset)], push(size), push(stride), [("NEWFALSE", None)], hooks)
    return call("torch._utils", "_rebuild_tensor_v2", *args)


def tensordict(fields: dict[str, Sequence[Op]], batch_size: list[int]) -> list[Op]:
    """An unconsolidated TensorDict, as tensordict's ``_make_td`` pickles one."""
    items = [op for key, value in fields.items() for op in [("SHORT_BINUNICODE", key), *value, ("SETITEM", None)]]
    state = [("EMPTY_DICT", None), ("SHORT_BINUNICODE", "_tensordict"), ("EMPTY_DICT", None), *items, ("SETITEM", None)]
    state += [("SHORT_BINUNICODE", "_batch_size"), *push(batch_size), ("SETITEM", None)]
    return call("tensordict._reductions", "_make_td", [("GLOBAL", ("tensordict._td", "TensorDict"))], state)


def torch_archive(data_pkl: Sequence[Op] | bytes, records: dict[str, bytes]) -> bytes:
    """A torch.save zip archive: ``data.pkl`` (ops, or bytes as they are) and storage records."""
    pkl = data_pkl if isinstance(data_pkl, bytes) else assemble([("PROTO", 2), *data_pkl, ("STOP", None)])
    members = {"archive/data.pkl": pkl, "archive/byteorder": sys.byteorder.encode()}
    return zip_archive({**members, **{f"archive/data/{key}": data for key, data in records.items()}})


def batch_archive(data_pkl: Sequence[Op] | bytes, records: dict[str, bytes]) -> bytes:
    """A DataProto whose batch is ``torch_archive(data_pkl, records)``."""
    return dataproto(dataproto_state([("BINBYTES", torch_archive(data_pkl, records))], [("EMPTY_DICT", None)]))


def shared(value: Sequence[Op], count: int) -> list[Op]:
    """A list of ``count`` references to one value (memoized once, then BINGET)."""
    ops = [*value, ("BINPUT", 0), ("POP", None), ("EMPTY_LIST", None)]
    for start in range(0, count, 1000):
        ops += [("MARK", None), *[("BINGET", 0)] * min(1000, count - start), ("APPENDS", None)]
    return ops


def doubling(levels: int) -> list[Op]:
    """``L0 = ['x' * 64]``, ``Lk = [L(k-1), L(k-1)]``: 2**levels strings once expanded, 14 bytes a level."""
    ops = [("EMPTY_LIST", None), ("SHORT_BINUNICODE", "x" * 64), ("APPEND", None), ("LONG_BINPUT", 0)]
    for k in range(1, levels + 1):
        ops += [("POP", None), ("EMPTY_LIST", None), ("LONG_BINGET", k - 1), ("APPEND", None)]
        ops += [("LONG_BINGET", k - 1), ("APPEND", None), ("LONG_BINPUT", k)]
    return ops


def central_sizes(archive: bytes, name: str, size: int) -> bytes:
    """``archive`` with the sizes its central directory records for ``name`` replaced by ``size``."""
    out, encoded, at = bytearray(archive), name.encode(), 0
    while (at := out.find(b"PK\x01\x02", at)) >= 0:
        length = struct.unpack_from("<H", out, at + 28)[0]
        if out[at + 46 : at + 46 + length] == encoded:
            struct.pack_into("<II", out, at + 20, size, size)
        at += 4
    return bytes(out)
