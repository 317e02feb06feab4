"""The opcodes of a pickle checked against its real size before the unpickler reads one.

CPython's unpickler trusts the sizes a pickle declares: ``BINBYTES8`` allocates the length it
reads before reading the bytes (40 bytes asking for 1 TB raise ``MemoryError``), and a memo
index (``LONG_BINPUT 268435456``, 5 bytes) grows the memo to twice that many slots and zeroes
them: a 40-byte verl dump took 4 GB. ``check_opcodes`` walks the opcode stream once, without
building anything, and refuses a length past the end of the data, a frame longer than what
follows it, and a memo index beyond the number of values memoized so far (a pickler numbers its
memo from 0 as it writes, so a real pickle never does): the unpickler's own memory (stack, marks,
memo) then stays within a small multiple of the pickle's size.
"""

from __future__ import annotations

import io
import pickletools
import struct

from skip_core.escaping import printable

from skip_plugin_verl.dumps.errors import UnsafePickleError

# Opcodes whose argument is a length followed by that many bytes: (struct format of the length).
_COUNTED = {
    "SHORT_BINSTRING": "<B", "BINSTRING": "<i", "SHORT_BINBYTES": "<B", "BINBYTES": "<I", "BINBYTES8": "<Q",
    "BYTEARRAY8": "<Q", "SHORT_BINUNICODE": "<B", "BINUNICODE": "<I", "BINUNICODE8": "<Q", "LONG1": "<B",
    "LONG4": "<i",
}  # fmt: skip
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_OPS = {op.code.encode("latin1"): op for op in pickletools.opcodes}


def check_opcodes(data: bytes, where: str) -> None:
    """Refuse ``data`` (``UnsafePickleError``, naming ``where`` and the opcode's offset) if an
    opcode is unknown, malformed, or declares more than the pickle holds, or if anything follows
    its STOP (pickle would ignore it; here it would only inflate the budget its size sets)."""
    reader, size, memoized = io.BytesIO(data), len(data), 0  # shares data's buffer: no copy
    while True:
        at = reader.tell()
        op = _OPS.get(reader.read(1))
        if op is None:
            what = "ends without pickle's STOP" if at >= size else f"has no pickle opcode at byte {at}"
            raise UnsafePickleError(f"{printable(where)} {what}")
        if op.name in _COUNTED:
            fmt = _COUNTED[op.name]
            raw = reader.read(struct.calcsize(fmt))
            if len(raw) < struct.calcsize(fmt):
                raise UnsafePickleError(f"{printable(where)}: {op.name} at byte {at} is cut short")
            (length,) = struct.unpack(fmt, raw)
            if not 0 <= length <= size - reader.tell():
                raise _past_end(where, op.name, at, length, size)
            reader.seek(length, io.SEEK_CUR)
            continue
        try:
            arg = op.arg.reader(reader) if op.arg is not None else None
        except ValueError as exc:  # cut short, or text that is not the number it should be
            raise UnsafePickleError(f"{printable(where)}: {op.name} at byte {at} is malformed ({exc})") from None
        if op.name == "FRAME" and arg > size - reader.tell():
            raise _past_end(where, op.name, at, arg, size)
        if op.name in _PUTS:
            if arg is not None and not 0 <= arg <= memoized:
                raise UnsafePickleError(
                    f"{printable(where)}: {op.name} at byte {at} declares memo slot {arg} after {memoized} values "
                    "(a pickler numbers its memo as it goes; this would allocate the slots in between)"
                )
            memoized += 1
        if op.name == "STOP":
            if reader.tell() < size:
                raise UnsafePickleError(
                    f"{printable(where)} holds {size - reader.tell()} bytes after its pickle's end, at byte {at}"
                )
            return


def _past_end(where: str, name: str, at: int, length: int, size: int) -> UnsafePickleError:
    return UnsafePickleError(
        f"{printable(where)}: {name} at byte {at} declares {length} bytes, past the end of its {size} bytes"
    )
