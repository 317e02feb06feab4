"""The ``torch.save`` archive of ``DataProto.batch``, read without ``torch.load``.

A torch zip archive holds ``data.pkl`` and one raw record per storage. ``data.pkl`` is read by a
``RestrictedUnpickler`` that knows only tensordict's and torch's rebuild functions, replaced here
by stand-ins that only collect data: tensors are rebuilt from the records' bytes, within their
bounds, and a TensorDict becomes its flat tensors and batch size.
"""

from __future__ import annotations

import collections
import io
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar

import torch

from skip_plugin_verl.restricted_pickle import (
    DTYPES,
    LEGACY_STORAGES,
    RestrictedUnpickler,
    Sealed,
    UnsafePickleError,
    VerlDumpError,
    sealed,
)


class _TensorDictClass(metaclass=Sealed):
    """Stands in for ``tensordict._td.TensorDict`` as the class argument of ``_make_td``."""


@dataclass
class TensorDictData:
    """What a pickled TensorDict becomes here: flat tensors and the batch size."""

    tensors: dict[str, torch.Tensor]
    batch_size: tuple[int, ...]


def _consolidated_td(metadata: Any, storage: Any) -> TensorDictData:
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
    return TensorDictData(tensors, tuple(int(n) for n in batch_size))


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


def _make_td(cls: Any, state: Any) -> TensorDictData:
    """tensordict's ``_make_td(TensorDict, state)``: an unconsolidated TensorDict's ``__dict__``."""
    if cls is not _TensorDictClass or not isinstance(state, Mapping):  # the class, as find_class returned it
        raise VerlDumpError(f"unexpected TensorDict reduction of {cls!r}")
    tensors = state.get("_tensordict") or {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise VerlDumpError(f"batch[{key!r}] is a {type(value).__name__}; skip stores flat tensors only")
    batch_size = state.get("_batch_size") or ()
    return TensorDictData(dict(tensors), tuple(int(n) for n in batch_size))


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
            self._flat[dtype] = from_bytes(self.data, dtype)
        return self._flat[dtype]


def from_bytes(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
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

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): _consolidated_td,
            ("tensordict._reductions", "_make_td"): _make_td,
            ("tensordict._td", "TensorDict"): _TensorDictClass,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("collections", "OrderedDict"): collections.OrderedDict,
            **{("torch", name): _StorageType(DTYPES[dtype]) for name, dtype in LEGACY_STORAGES.items()},
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


def load_torch_archive(source: bytes | BinaryIO, where: str, unpickler: type | None = None) -> Any:
    """What ``torch.load`` would return for ``source`` (the bytes, or an open file, of a
    ``torch.save`` archive), through ``unpickler`` only (a ``_TorchZipUnpickler``, by default this one)."""
    source = io.BytesIO(source) if isinstance(source, bytes) else source
    if not zipfile.is_zipfile(source):
        raise VerlDumpError(f"{where} is not a torch zip archive (legacy torch.save formats are not supported)")
    with zipfile.ZipFile(source) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise VerlDumpError(f"{where} is not a torch.save archive (data.pkl records: {pickles})")
        prefix = pickles[0].removesuffix("/data.pkl")
        if f"{prefix}/byteorder" in archive.namelist():
            order = archive.read(_stored_info(archive, f"{prefix}/byteorder", where)).decode("ascii", "replace")
            if order != sys.byteorder:
                raise VerlDumpError(f"{where} was written on a {order}-endian machine")
        return (unpickler or _TorchZipUnpickler)(archive, prefix, where).load()
