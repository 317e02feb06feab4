"""An unpickler that resolves only the globals it is given and refuses every other one.

Reading a pickle can run code: ``find_class`` is where a pickle names the functions it calls, so
``RestrictedUnpickler`` answers it from a fixed allow-list and raises ``UnsafePickleError``
naming anything else. What it returns cannot be modified through pickle's BUILD opcode
(``sealed``). ``DTYPES`` and numpy's pickle support are the names verl's dumps need.
"""

from __future__ import annotations

import importlib
import pickle
import types
from collections.abc import Callable, Mapping
from typing import IO, Any, ClassVar

import numpy as np
import torch


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle needs a global that this importer does not load (it could run code, or holds unstorable data)."""


class VerlDumpError(ValueError):
    """A dump that is not in verl's rollout-skip format or cannot be stored as a skip entry."""


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


def _numpy_global(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that has it: numpy 2 renamed ``numpy.core`` to ``numpy._core``."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"numpy has no {name} in {modules}")


def numpy_globals() -> dict[tuple[str, str], Any]:
    """numpy's pickle support: arrays (object arrays included), dtypes and scalars."""
    reconstruct = _numpy_global("_reconstruct", "numpy._core.multiarray", "numpy.core.multiarray")
    scalar = _numpy_global("scalar", "numpy._core.multiarray", "numpy.core.multiarray")
    frombuffer = _numpy_global("_frombuffer", "numpy._core.numeric", "numpy.core.numeric")
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for package in ("numpy._core", "numpy.core"):  # pickles name the module of the numpy that wrote them
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    return allowed


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


class _Global:
    """An allowed Python function as ``find_class`` returns it: callable, but not modifiable.

    pickle's BUILD opcode sets attributes on whatever object is on the stack, globals
    included; a function's ``__defaults__`` or ``__dict__`` must not be reachable that way.
    Classes and functions implemented in C (numpy's, torch's) are immutable already.
    """

    __slots__ = ("_function",)

    def __init__(self, function: Callable) -> None:
        object.__setattr__(self, "_function", function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {name!r} on {self._function.__qualname__}")

    def __delattr__(self, name: str) -> None:
        raise UnsafePickleError(f"refusing to delete {name!r} from {self._function.__qualname__}")


def sealed(allowed: Mapping[tuple[str, str], Any]) -> Mapping[tuple[str, str], Any]:
    """``allowed`` as a read-only mapping, its Python functions wrapped in ``_Global``."""
    return types.MappingProxyType(
        {key: _Global(value) if isinstance(value, types.FunctionType) else value for key, value in allowed.items()}
    )


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in ``allowed`` and refuses all others.

    ``where`` names the pickle in its errors.
    """

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = {}

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        reason = _UNSUPPORTED.get((module, name))
        if reason is not None:
            raise UnsafePickleError(f"{self.where} contains {reason} (global {module}.{name}); it cannot be imported")
        raise UnsafePickleError(
            f"refusing to load global {module}.{name} from {self.where}: a verl rollout dump only "
            "references DataProto, numpy arrays and tensordict/torch tensor rebuilds; this file was "
            "not written by verl's rollout skip or was tampered with"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing persistent id {pid!r} in {self.where}")
