"""numpy's pickle support, replaced by stand-ins that build arrays only from checked parts.

numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')`` and then BUILD with the state
``(1, shape, dtype, is_fortran, data)``, a dtype as ``dtype(name, align, copy)`` then BUILD with
``(3, byteorder, subarray, names, fields, elsize, alignment, flags)``, a scalar as
``scalar(dtype, bytes)``, and at protocol 5 an array as ``_frombuffer(buffer, dtype, shape,
order)``. Handed to numpy's own functions, these states are trusted: a dtype whose flags say it
holds no objects, or an object array given bytes, makes ``ndarray.__setstate__`` read the file's
bytes as object pointers (an address of ``os.system`` came back as ``os.system``; any other
crashed the process), and ``_reconstruct(ndarray, (2**28,), b'O')`` fills 2 GB with ``None``.

Here every one of these names resolves to a stand-in that only collects its arguments and
state. A dtype is rebuilt from its name alone, and only for booleans, integers, floats,
complex numbers and fixed-width strings (``DTYPE_NAME``); its state may only confirm that
(no subarray, no fields). Numeric data must be exactly ``shape`` × item size bytes, charged
to the file's budget before numpy sees it, and is copied into an array of its own. An object
array is never built from bytes: numpy pickles it with the list of its values, which
``plain_values`` checks value by value before the array exists.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from skip_plugin_verl.dumps.budget import charge
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.restricted_pickle import Marker, StandIn, describe, ints

# bool, (u)int8-64, float16-64, complex64/128, bytes and UCS4 strings of fewer than 10**7
# characters (an item's bytes must be in the file anyway; the cap keeps numpy's item size in range).
DTYPE_NAME = re.compile(r"b1|[iu][1248]|f[248]|c(?:8|16)|[SU][1-9][0-9]{0,6}")
_OBJECT_NAMES = ("O8", "O4", "O")  # what numpy writes for ``dtype(object)``, by pointer size
_BYTE_ORDERS = ("<", ">", "|", "=")
_MAX_CODE_POINT = 0x10FFFF  # numpy stores any 32-bit number in a U item; Python's str refuses more


class _NdarrayClass(Marker):
    """Stands in for ``numpy.ndarray`` as the class argument of ``_reconstruct``."""


class PickledDtype(StandIn):
    """Stands in for ``numpy.dtype(name, align, copy)``; its BUILD state settles the byte order."""

    __slots__ = ("dtype", "name")

    def __new__(cls, name: Any, align: Any = False, copy: Any = True) -> PickledDtype:
        if not isinstance(name, str) or not (DTYPE_NAME.fullmatch(name) or name in _OBJECT_NAMES):
            raise UnsafePickleError(
                f"refusing numpy dtype {describe(name)}: only booleans, numbers, fixed-width strings and "
                "object arrays of plain values are read"
            )
        if align not in (False, 0) or copy not in (True, False, 1, 0):
            raise UnsafePickleError(f"refusing numpy dtype {name} with align={describe(align)}")
        self = object.__new__(cls)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", None)
        return self

    def __setstate__(self, state: Any) -> None:
        if self.dtype is not None:
            raise UnsafePickleError(f"refusing a second state for numpy dtype {self.name}")
        if not isinstance(state, tuple) or len(state) != 8 or state[0] != 3:
            raise UnsafePickleError(f"refusing numpy dtype {self.name} with state {describe(state)}")
        _, order, subarray, names, fields, elsize, alignment, flags = state
        if subarray is not None or names is not None or fields is not None:
            raise UnsafePickleError(f"refusing numpy dtype {self.name} with a subarray or fields")
        if order not in _BYTE_ORDERS or not all(type(n) is int for n in (elsize, alignment, flags)):
            raise UnsafePickleError(f"refusing numpy dtype {self.name} with state {describe(state)}")
        # Built from the name alone: the state's flags and sizes are never given to numpy.
        dtype = np.dtype(object) if self.name in _OBJECT_NAMES else np.dtype(self.name)
        if order in "<>" and dtype.kind in "iufcU" and dtype.itemsize > 1:
            dtype = dtype.newbyteorder(order)
        if elsize not in (-1, dtype.itemsize):
            raise UnsafePickleError(f"refusing numpy dtype {self.name} declaring items of {elsize} bytes")
        object.__setattr__(self, "dtype", dtype)

    def checked(self, *, objects: bool = False) -> np.dtype:
        """The dtype, once its state is in; the object dtype only where ``objects`` allows it."""
        if self.dtype is None:
            raise UnsafePickleError(f"numpy dtype {self.name} used before its state")
        if self.dtype.hasobject and not objects:
            raise UnsafePickleError("refusing numpy object data given as raw bytes")
        return self.dtype


def _dtype_of(value: Any, *, objects: bool = False) -> np.dtype:
    if not isinstance(value, PickledDtype):
        raise UnsafePickleError(f"numpy data with dtype {describe(value)}, which is not a numpy dtype")
    return value.checked(objects=objects)


def _from_bytes(data: Any, dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> np.ndarray:
    """A new array of ``shape`` from exactly its bytes ``data``, charged before it is built."""
    count = math.prod(shape)
    if not isinstance(data, (bytes, bytearray)) or len(data) != count * dtype.itemsize:
        size = len(data) if isinstance(data, (bytes, bytearray)) else describe(data)
        raise VerlDumpError(
            f"numpy array of shape {shape} and dtype {dtype.str} given {size} bytes, not {count * dtype.itemsize}"
        )
    charge(len(data), f"a numpy array of shape {shape} and dtype {dtype.str}")
    flat = np.frombuffer(data, dtype=dtype)
    if dtype.kind == "U" and len(flat) and int(flat.view(f"{dtype.byteorder}u4").max()) > _MAX_CODE_POINT:
        raise VerlDumpError(f"numpy string array of dtype {dtype.str} holds characters past U+10FFFF")
    return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


class PickledArray(StandIn):
    """Stands in for the array ``_reconstruct`` starts and BUILD fills: numeric data becomes an
    array of its own at once; an object array keeps its list of values for ``plain_values``."""

    __slots__ = ("array", "shape", "values")

    def __new__(cls) -> PickledArray:
        self = object.__new__(cls)
        for slot in cls.__slots__:
            object.__setattr__(self, slot, None)
        return self

    def __setstate__(self, state: Any) -> None:
        if self.shape is not None:
            raise UnsafePickleError("refusing a second state for a numpy array")
        if not isinstance(state, tuple) or len(state) != 5 or state[0] != 1:
            raise UnsafePickleError(f"refusing numpy array state {describe(state)}")
        _, shape, dtype, fortran, data = state
        shape = ints(shape, "numpy array shape")
        if type(fortran) is not bool:
            raise UnsafePickleError(f"refusing numpy array state with order {describe(fortran)}")
        dtype = _dtype_of(dtype, objects=True)
        if dtype.hasobject:
            if type(data) is not list or len(data) != math.prod(shape):
                raise UnsafePickleError(
                    f"refusing a numpy object array of shape {shape} whose values are not a list of that many "
                    f"(numpy pickles them so; {describe(data)} could be read as object pointers)"
                )
            object.__setattr__(self, "values", list(data))  # a copy: the pickle may append to its list later
        else:
            object.__setattr__(self, "array", _from_bytes(data, dtype, shape, fortran))
        object.__setattr__(self, "shape", shape)

    def numeric(self, what: str) -> np.ndarray:
        """The array, which must be a numeric (or fixed-width string) one that has its data."""
        if self.array is None:
            raise VerlDumpError(f"{what} is a numpy array without its numeric data")
        return self.array


def _reconstruct(cls: Any, shape: Any, code: Any) -> PickledArray:
    """numpy's ``_reconstruct``: only as numpy calls it before BUILD, ``(ndarray, (0,), b'b')``."""
    if cls is not _NdarrayClass or shape != (0,) or code != b"b":
        raise UnsafePickleError(
            f"refusing numpy _reconstruct({describe(cls)}, {describe(shape)}, {describe(code)}): numpy only "
            "reconstructs an empty array before giving it its state"
        )
    return PickledArray()


def _frombuffer(data: Any, dtype: Any, shape: Any, order: Any) -> PickledArray:
    """numpy's ``_frombuffer`` (protocol 5): an array from its bytes, in band."""
    if order not in ("C", "F"):
        raise UnsafePickleError(f"refusing numpy array order {describe(order)}")
    array = PickledArray()
    shape = ints(shape, "numpy array shape")
    object.__setattr__(array, "array", _from_bytes(data, _dtype_of(dtype), shape, order == "F"))
    object.__setattr__(array, "shape", shape)
    return array


class PickledScalar(StandIn):
    """A numpy scalar (``numpy.float64(0.5)``) from ``scalar(dtype, bytes)``: exactly one item's bytes."""

    __slots__ = ("value",)

    def __new__(cls, dtype: Any, data: Any) -> PickledScalar:
        array = _from_bytes(data, _dtype_of(dtype), (1,), False)
        self = object.__new__(cls)
        object.__setattr__(self, "value", array[0])
        return self


def numpy_globals() -> dict[tuple[str, str], Any]:
    """numpy's pickle support as stand-ins, under the module names numpy 1 and 2 pickle them."""
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): _NdarrayClass, ("numpy", "dtype"): PickledDtype}
    for package in ("numpy._core", "numpy.core"):
        allowed[(f"{package}.multiarray", "_reconstruct")] = _reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = PickledScalar
        allowed[(f"{package}.numeric", "_frombuffer")] = _frombuffer
    return allowed
