"""An unpickler that resolves only the globals it is given and refuses every other one.

Reading a pickle can run code: ``find_class`` is where a pickle names the functions it calls, so
``RestrictedUnpickler`` answers it from a fixed allow-list and raises ``UnsafePickleError``
naming anything else. What it returns cannot be modified through pickle's BUILD opcode
(``sealed``, ``StandIn``). Before a byte is unpickled, ``pickle_scan.check_opcodes`` refuses
opcodes that declare more than the pickle holds; whatever else goes wrong inside pickle, numpy
or torch while loading comes out as one ``UnsafePickleError`` line naming the file.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import reprlib
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from skip_core.escaping import printable

from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.pickle_scan import check_opcodes

# -- messages ----------------------------------------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def describe(value: Any) -> str:
    """A short, one-line description of a value read from a file, safe on any value: reprlib
    bounds size and depth, and a repr that raises (an int of 5,000 digits) gives the type."""
    try:
        text = _REPR.repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return printable(text)


def describe_error(exc: BaseException) -> str:
    """``exc`` as one bounded line: its type and the start of its message (if it can be had: the
    message of a ``KeyError`` is the repr of its key, which a file can nest past the recursion limit)."""
    try:
        message = printable(str(exc))
    except Exception:
        message = "(a message that cannot be shown)"
    return f"{type(exc).__name__}: {message[:200]}{'...' if len(message) > 200 else ''}"


# -- the globals a verl dump may name --------------------------------------------------------

# A fixed list, so that no attribute of torch is looked up by a name taken from a file.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
# "float32" -> torch.float32, for the names this torch has.
DTYPES: dict[str, torch.dtype] = {
    name: dtype for name in _DTYPE_NAMES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
# torch.save names a storage by its legacy typed class (``torch.FloatStorage``) or ``UntypedStorage``.
LEGACY_STORAGES = {
    "BoolStorage": "bool", "ByteStorage": "uint8", "CharStorage": "int8", "ShortStorage": "int16",
    "IntStorage": "int32", "LongStorage": "int64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "FloatStorage": "float32", "DoubleStorage": "float64", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}  # fmt: skip

_TENSOR_IN_DATA = (
    "a torch tensor inside non_tensor_batch or meta_info (e.g. multi_modal_inputs), which a skip entry cannot "
    "store as data"
)
# Globals that a verl dump can hold but an import cannot use: refused with the reason.
_UNSUPPORTED = {
    ("torch.storage", "_load_from_bytes"): _TENSOR_IN_DATA,
    ("torch._utils", "_rebuild_tensor_v2"): _TENSOR_IN_DATA,
    ("PIL.Image", "Image"): "an image inside non_tensor_batch (multi_modal_data), which a skip entry cannot store",
}


class Sealed(type):
    """Metaclass of the stand-in classes: pickle's BUILD cannot set attributes on them."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {name!r} on {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise UnsafePickleError(f"refusing to delete {name!r} from {cls.__name__}")

    def __repr__(cls) -> str:
        return f"<{cls.__name__}>"


class StandIn(metaclass=Sealed):
    """Base of the objects stand-ins build: slots only (no ``__dict__`` for BUILD to fill), and no
    attribute set from outside; a subclass sets its slots with ``object.__setattr__``."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {name!r} on {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise UnsafePickleError(f"refusing to delete {name!r} from {type(self).__name__}")


class Marker(StandIn):
    """A class a pickle names only to pass it on (``numpy.ndarray`` to ``_reconstruct``,
    ``TensorDict`` to ``_make_td``), compared by identity: never instantiated."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Marker:
        raise UnsafePickleError(f"refusing to instantiate {cls.__name__}")


class _Global:
    """An allowed Python function as ``find_class`` returns it: callable, but not modifiable.

    pickle's BUILD opcode sets attributes on whatever object is on the stack, globals
    included; a function's ``__defaults__`` or ``__dict__`` must not be reachable that way.
    """

    __slots__ = ("_function",)

    def __init__(self, function: Callable) -> None:
        object.__setattr__(self, "_function", function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self._function.__qualname__}>"

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {name!r} on {self._function.__qualname__}")

    def __delattr__(self, name: str) -> None:
        raise UnsafePickleError(f"refusing to delete {name!r} from {self._function.__qualname__}")


def sealed(allowed: Mapping[tuple[str, str], Any]) -> Mapping[tuple[str, str], Any]:
    """``allowed`` as a read-only mapping, its Python functions wrapped in ``_Global``."""
    return types.MappingProxyType(
        {key: _Global(value) if isinstance(value, types.FunctionType) else value for key, value in allowed.items()}
    )


@contextlib.contextmanager
def reader_errors(where: str) -> Iterator[None]:
    """Whatever decoding a dump raises comes out as this importer's errors, on one line: torch,
    numpy and zipfile raise their own on data they were never meant to be given."""
    try:
        yield
    except (UnsafePickleError, VerlDumpError):
        raise
    except Exception as exc:
        raise VerlDumpError(f"{printable(where)} is not a dump this importer can read: {describe_error(exc)}") from None


def ints(value: Any, what: str) -> tuple[int, ...]:
    """``value`` (a tuple, list or ``torch.Size``) as non-negative Python ints: a shape, strides."""
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(type(n) is int and n >= 0 for n in value):
        raise VerlDumpError(f"{what} is {describe(value)}, not a list of at most 64 non-negative integers")
    return tuple(value)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler of ``data`` that resolves only the globals in ``allowed`` and refuses all others.

    ``where`` names the pickle in its errors.
    """

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = {}

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.data = data
        self.where = where

    def load(self) -> Any:
        try:
            check_opcodes(self.data, self.where)
            return super().load()
        except (UnsafePickleError, VerlDumpError):
            raise
        except Exception as exc:  # pickle's own, and what numpy or torch raised inside a stand-in
            raise UnsafePickleError(f"{printable(self.where)} does not unpickle: {describe_error(exc)}") from None

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        where, named = printable(self.where), printable(f"{module}.{name}")
        reason = _UNSUPPORTED.get((module, name))
        if reason is not None:
            raise UnsafePickleError(f"{where} contains {reason} (global {named}); it cannot be imported")
        raise UnsafePickleError(
            f"refusing to load global {named} from {where}: a verl rollout dump only "
            "references DataProto, numpy arrays and tensordict/torch tensor rebuilds; this file was "
            "not written by verl's rollout skip or was tampered with"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing persistent id {describe(pid)} in {printable(self.where)}")
