"""Decode verl's ``gen_batch.dp`` pickles into skip ``Batch``es without running code from them.

``DataProto.save_to_disk`` (verl 0.9.1, ``verl/protocol.py``) is a ``pickle.dump`` of the
DataProto, whose ``__getstate__`` gives the tuple ``(batch, non_tensor_batch, meta_info)``.
``batch`` is, by default, the bytes of ``torch.save`` of the consolidated TensorDict: a torch
zip archive whose ``data.pkl`` calls
``tensordict._reductions._rebuild_tensordict_files_consolidated(metadata, storage)`` with one
flat uint8 storage and per-key ``(dtype, shape, start, stop, pad)`` slices of it (an empty
TensorDict is saved unconsolidated, through ``_make_td(TensorDict, state)``; a missing batch
as ``None``). With ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` it is instead
``(batch_size, device, {key: (dtype, shape, uint8 numpy array)})``. ``non_tensor_batch`` is
a dict of numpy arrays and ``meta_info`` a dict, pickled as they are.

Reading a pickle can run code, so nothing here calls ``pickle.load`` or ``torch.load``: both
levels are read by ``RestrictedUnpickler`` subclasses whose ``find_class`` resolves only the
globals listed in this module (numpy's array reconstruction, ``torch.Size``, and stand-ins
for verl's ``DataProto`` and tensordict's rebuild functions that only collect data; tensors
are rebuilt here from the archive's raw storage records) and refuses any other global with
an ``UnsafePickleError`` naming it. What ``find_class`` returns cannot be modified through
pickle's BUILD opcode.
"""

from __future__ import annotations

import collections
import importlib
import io
import os
import pickle
import sys
import types
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np
import torch
from skip_core.batch import Batch


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
_LEGACY_STORAGES = {
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


def _numpy_globals() -> dict[tuple[str, str], Any]:
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


class _Sealed(type):
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


def _sealed(allowed: Mapping[tuple[str, str], Any]) -> Mapping[tuple[str, str], Any]:
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


# -- stand-ins for verl's and tensordict's globals -------------------------------------------


class _DataProtoState(metaclass=_Sealed):
    """Stands in for ``verl.protocol.DataProto``: keeps the state ``__setstate__`` receives."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _TensorDictClass(metaclass=_Sealed):
    """Stands in for ``tensordict._td.TensorDict`` as the class argument of ``_make_td``."""


@dataclass
class _TensorDict:
    """What a pickled TensorDict becomes here: flat tensors and the batch size."""

    tensors: dict[str, torch.Tensor]
    batch_size: tuple[int, ...]


def _consolidated_td(metadata: Any, storage: Any) -> _TensorDict:
    """tensordict's ``_rebuild_tensordict_files_consolidated``: slices of one flat uint8 storage."""
    if not isinstance(storage, torch.Tensor) or storage.dtype != torch.uint8 or storage.dim() != 1:
        raise VerlDumpError("consolidated TensorDict without a flat uint8 storage")
    if not isinstance(metadata, Mapping):
        raise VerlDumpError("consolidated TensorDict without metadata")
    meta = dict(metadata)
    non_tensors = meta.pop("non_tensors", None) or {}
    leaves = meta.pop("leaves", None)
    cls = meta.pop("cls", None)
    cls_metadata = meta.pop("cls_metadata", None) or {}
    meta.pop("size", None)
    if cls != "TensorDict":
        raise VerlDumpError(f"batch is a {cls!r}, not a TensorDict")
    if meta:  # what is left are the keys of nested TensorDicts
        raise VerlDumpError(f"batch has nested TensorDicts {sorted(map(str, meta))}; skip stores flat tensors only")
    if non_tensors:
        raise VerlDumpError(f"batch TensorDict has non-tensor entries {sorted(map(str, non_tensors))}")
    if not isinstance(leaves, Mapping):
        raise VerlDumpError("consolidated TensorDict metadata has no leaves")
    tensors = {key: _consolidated_leaf(storage, key, spec) for key, spec in leaves.items()}
    batch_size = cls_metadata.get("batch_size", ()) if isinstance(cls_metadata, Mapping) else ()
    return _TensorDict(tensors, tuple(int(n) for n in batch_size))


def _consolidated_leaf(storage: torch.Tensor, key: Any, spec: Any) -> torch.Tensor:
    """The tensor ``batch[key]``: its ``(dtype, shape, start, stop, pad)`` slice of the flat storage."""
    if not isinstance(key, str) or key.startswith("<NJT"):
        raise VerlDumpError(f"batch[{key!r}] is a nested (jagged) tensor, which skip cannot store")
    try:
        dtype_name, shape, start, stop, pad = spec
        dtype = DTYPES[str(dtype_name).removeprefix("torch.")]
        shape = torch.Size([int(n) for n in shape])
        value = storage[int(start) : int(stop)].view(dtype)
        if pad:
            value = value[: shape.numel()]
        return value.view(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise VerlDumpError(f"batch[{key!r}]: bad consolidated leaf {spec!r} ({exc})") from None


def _make_td(cls: Any, state: Any) -> _TensorDict:
    """tensordict's ``_make_td(TensorDict, state)``: an unconsolidated TensorDict's ``__dict__``."""
    if cls is not _TensorDictClass or not isinstance(state, Mapping):  # the class, as find_class returned it
        raise VerlDumpError(f"unexpected TensorDict reduction of {cls!r}")
    tensors = state.get("_tensordict") or {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise VerlDumpError(f"batch[{key!r}] is a {type(value).__name__}; skip stores flat tensors only")
    batch_size = state.get("_batch_size") or ()
    return _TensorDict(dict(tensors), tuple(int(n) for n in batch_size))


# -- the torch.save archive of DataProto.batch -----------------------------------------------


@dataclass(frozen=True, slots=True)
class _StorageType:
    """A storage class of torch as ``find_class`` returns it: all a storage record needs is its dtype."""

    dtype: torch.dtype


class _Storage:
    """One ``data/{key}`` record of a torch zip archive, read as bytes."""

    def __init__(self, data: bytearray, dtype: torch.dtype) -> None:
        self.data = data
        self.dtype = dtype
        self._flat: dict[torch.dtype, torch.Tensor] = {}

    def flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The record as a 1-d tensor of ``dtype`` (its own by default), over the same bytes."""
        dtype = dtype or self.dtype
        if dtype not in self._flat:
            self._flat[dtype] = _from_bytes(self.data, dtype)
        return self._flat[dtype]


def _from_bytes(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor over ``data``, not a copy (``torch.frombuffer`` refuses an empty buffer)."""
    if len(data) % dtype.itemsize:
        raise VerlDumpError(f"{len(data)} bytes are not a whole number of {dtype} elements")
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v2``, on a storage record read by ``_TorchZipUnpickler``."""
    return _view(storage, None, offset, size, stride, hooks, metadata)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None) -> torch.Tensor:
    """torch's ``_rebuild_tensor_v3`` (dtypes without a legacy storage class, e.g. uint16)."""
    if not isinstance(dtype, torch.dtype):
        raise VerlDumpError(f"tensor rebuilt as {dtype!r}, which is not a torch dtype")
    return _view(storage, dtype, offset, size, stride, hooks, metadata)


def _view(storage: Any, dtype: torch.dtype | None, offset, size, stride, hooks, metadata) -> torch.Tensor:
    """The tensor a rebuild describes: a view of its storage read as ``dtype``, within its bounds."""
    if not isinstance(storage, _Storage):
        raise VerlDumpError("tensor rebuilt from something that is not a storage")
    if hooks or metadata:
        raise VerlDumpError("tensor with backward hooks or tensor metadata")
    size, stride = tuple(int(n) for n in size), tuple(int(n) for n in stride)
    return torch.as_strided(storage.flat(dtype), size, stride, int(offset))  # raises past the storage's end


class _TorchZipUnpickler(RestrictedUnpickler):
    """``data.pkl`` of the ``torch.save`` archive of ``DataProto.batch``; storages come from the archive."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = _sealed(
        {
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): _consolidated_td,
            ("tensordict._reductions", "_make_td"): _make_td,
            ("tensordict._td", "TensorDict"): _TensorDictClass,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("collections", "OrderedDict"): collections.OrderedDict,
            **{("torch", name): _StorageType(DTYPES[dtype]) for name, dtype in _LEGACY_STORAGES.items()},
            ("torch.storage", "UntypedStorage"): _StorageType(torch.uint8),  # with _rebuild_tensor_v3
            **{("torch", name): dtype for name, dtype in DTYPES.items()},
        }
    )

    def __init__(self, archive: zipfile.ZipFile, prefix: str, where: str) -> None:
        super().__init__(io.BytesIO(archive.read(_stored_info(archive, f"{prefix}/data.pkl", where))), where)
        self.archive = archive
        self.prefix = prefix
        self.storages: dict[str, _Storage] = {}

    def persistent_load(self, pid: Any) -> Any:
        """``torch.save``'s reference to a storage record: ``("storage", type, key, location, numel)``."""
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise UnsafePickleError(f"refusing persistent id {pid!r} in {self.where}")
        kind, storage_type, key, _location, numel = pid
        kind = kind.decode("ascii") if isinstance(kind, bytes) else kind
        if kind != "storage" or not isinstance(storage_type, _StorageType) or not isinstance(key, str):
            raise UnsafePickleError(f"refusing persistent id {pid!r} in {self.where}")
        if key not in self.storages:  # tensors sharing a storage reference it once each
            self.storages[key] = self._read_storage(key, storage_type.dtype, numel)
        return self.storages[key]

    def _read_storage(self, key: str, dtype: torch.dtype, numel: Any) -> _Storage:
        """The record ``data/{key}``, which must hold exactly ``numel`` elements of ``dtype``."""
        name = f"{self.prefix}/data/{key}"
        info = _stored_info(self.archive, name, self.where)
        expected = int(numel) * dtype.itemsize
        if info.file_size != expected:
            raise VerlDumpError(f"storage record {name} has {info.file_size} bytes, expected {expected}")
        data = bytearray(info.file_size)
        with self.archive.open(info) as f:
            f.readinto(data)
        return _Storage(data, dtype)


def _stored_info(archive: zipfile.ZipFile, name: str, where: str) -> zipfile.ZipInfo:
    """A record of a torch archive; torch stores every record uncompressed, so sizes are bounded."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise VerlDumpError(f"{where} lacks the record {name}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise VerlDumpError(f"{where}: record {name} is compressed, which torch.save never does")
    return info


def _load_torch_archive(raw: bytes, where: str) -> Any:
    """What ``torch.load`` would return for ``raw``, through ``_TorchZipUnpickler`` only."""
    if not zipfile.is_zipfile(io.BytesIO(raw)):
        raise VerlDumpError(f"{where} is not a torch zip archive (legacy torch.save formats are not supported)")
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise VerlDumpError(f"{where} is not a torch.save archive (data.pkl records: {pickles})")
        prefix = pickles[0].removesuffix("/data.pkl")
        if f"{prefix}/byteorder" in archive.namelist():
            order = archive.read(_stored_info(archive, f"{prefix}/byteorder", where)).decode("ascii", "replace")
            if order != sys.byteorder:
                raise VerlDumpError(f"{where} was written on a {order}-endian machine")
        return _TorchZipUnpickler(archive, prefix, where).load()


# -- the DataProto ---------------------------------------------------------------------------


class _OuterUnpickler(RestrictedUnpickler):
    """The ``gen_batch.dp`` pickle: a DataProto whose state holds numpy data and bytes."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = _sealed(
        {
            ("verl.protocol", "DataProto"): _DataProtoState,
            ("torch", "Size"): torch.Size,  # VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
            ("collections", "OrderedDict"): collections.OrderedDict,
            **_numpy_globals(),
        }
    )


def _decode_numpy_batch(state: Any) -> _TensorDict:
    """The batch as ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` writes it."""
    try:
        batch_size, _device, items = state
    except (TypeError, ValueError):
        raise VerlDumpError("batch is neither torch.save bytes nor verl's numpy serialization") from None
    tensors = {}
    for key, value in dict(items).items():
        if not isinstance(value, tuple) or len(value) != 3:
            raise VerlDumpError(f"batch[{key!r}] is a nested tensor, which skip cannot store")
        dtype_name, shape, data = value
        dtype = DTYPES.get(str(dtype_name))
        if dtype is None or not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise VerlDumpError(f"batch[{key!r}]: bad numpy-serialized tensor ({dtype_name!r})")
        flat = _from_bytes(bytearray(data.tobytes()), dtype)
        tensors[key] = flat.view(tuple(int(n) for n in shape))
    return _TensorDict(tensors, tuple(int(n) for n in batch_size))


def _decode_batch(state: Any, where: str) -> _TensorDict | None:
    """``DataProto.batch`` from its pickled state: ``torch.save`` bytes, ``None``, or verl's numpy form."""
    if state is None:
        return None
    batch = _load_torch_archive(state, where) if isinstance(state, bytes) else _decode_numpy_batch(state)
    if batch is not None and not isinstance(batch, _TensorDict):  # torch.save(None) is a DataProto without tensors
        raise VerlDumpError(f"DataProto.batch is a {type(batch).__name__}, not a TensorDict")
    return batch


def read_gen_batch(path: str | os.PathLike) -> Batch:
    """Decode one verl ``gen_batch.dp`` into a ``Batch`` without running code from it."""
    path = Path(path)
    with open(path, "rb") as f:
        proto = _OuterUnpickler(f, str(path)).load()
    if not isinstance(proto, _DataProtoState):
        raise VerlDumpError(f"holds a {type(proto).__name__}, not a verl DataProto")
    state = proto.state
    if not isinstance(state, tuple) or len(state) != 3:
        raise VerlDumpError("DataProto state is not verl's (batch, non_tensor_batch, meta_info)")
    batch_state, non_tensors, meta_info = state
    batch = _decode_batch(batch_state, f"{path} (DataProto.batch)")
    if not isinstance(non_tensors, dict) or not isinstance(meta_info, (dict, type(None))):
        raise VerlDumpError("DataProto non_tensor_batch/meta_info are not dicts")
    tensors = batch.tensors if batch is not None else {}
    result = Batch(tensors, non_tensors, meta_info)
    if batch is not None and batch.batch_size and tensors and batch.batch_size[0] != len(result):
        raise VerlDumpError(f"TensorDict batch size {batch.batch_size} disagrees with its tensors")
    return result
