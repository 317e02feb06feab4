"""The ``torch.save`` archive of ``DataProto.batch``, read without ``torch.load``.

A torch zip archive holds ``data.pkl`` and one raw record per storage. ``data.pkl`` is read by a
``RestrictedUnpickler`` that knows only tensordict's and torch's rebuild functions, replaced here
by stand-ins that only collect data: tensors are rebuilt from the records' bytes, and a
TensorDict becomes its flat tensors and batch size.

Every size the archive declares is checked against what it holds before anything that size
exists: a record's size in the central directory must be its size in its local header and fit
in the archive after it (a 515-byte file declaring a 2 GB record took 2 GB), a storage must be
exactly the record's bytes, and a tensor may address no element past its storage nor more
elements than the storage has (``as_strided`` with stride 0 over one element declared 2**28 of
them, which the cache entry then wrote out as 2 GB). What is built is charged to the file's
budget (``budget``).
"""

from __future__ import annotations

import io
import math
import struct
import sys
import zipfile
from collections.abc import Mapping
from typing import Any, BinaryIO, ClassVar

import torch
from skip_core.escaping import printable

from skip_plugin_verl.dumps.budget import charge
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.restricted_pickle import (
    DTYPES,
    LEGACY_STORAGES,
    Marker,
    RestrictedUnpickler,
    StandIn,
    describe,
    describe_error,
    ints,
    sealed,
)

_CHUNK = 1 << 20  # a storage record is read into its buffer this much at a time
_LEAF_DTYPES = {f"torch.{name}": dtype for name, dtype in DTYPES.items()}  # as tensordict names them


class TensorDictClass(Marker):
    """Stands in for ``tensordict._td.TensorDict`` as the class argument of ``_make_td``."""


class TensorDictData(StandIn):
    """What a pickled TensorDict becomes here: flat tensors and the batch size (a stand-in: the
    pickle can reach it, and BUILD would set a dataclass's attributes)."""

    __slots__ = ("batch_size", "tensors")

    def __new__(cls, tensors: dict[str, Any], batch_size: tuple[int, ...]) -> TensorDictData:
        self = object.__new__(cls)
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "batch_size", batch_size)
        return self


class PickledTensor(StandIn):
    """A tensor as the stand-ins hand it to the pickle: held, never on the pickle's stack itself,
    where BUILD would call ``Tensor.__setstate__`` and ``set_`` would point it at any storage, size
    and strides (a stride 0 over one element, 2**28 of them: 643 bytes wrote a 2 GB entry)."""

    __slots__ = ("tensor",)

    def __new__(cls, tensor: torch.Tensor) -> PickledTensor:
        self = object.__new__(cls)
        object.__setattr__(self, "tensor", tensor)
        return self


def tensor_of(value: Any, what: str) -> torch.Tensor:
    """The tensor a rebuild gave, or ``VerlDumpError`` naming ``what`` for anything else."""
    if not isinstance(value, PickledTensor):
        raise VerlDumpError(f"{what} is a {type(value).__name__}, not a tensor")
    return value.tensor


def _consolidated_td(metadata: Any, storage: Any) -> TensorDictData:
    """tensordict's ``_rebuild_tensordict_files_consolidated``: slices of one flat uint8 storage."""
    storage = tensor_of(storage, "a consolidated TensorDict's storage")
    if storage.dtype != torch.uint8 or storage.dim() != 1:
        raise VerlDumpError("consolidated TensorDict without a flat uint8 storage")
    if type(metadata) is not dict:
        raise VerlDumpError("consolidated TensorDict without metadata")
    meta = dict(metadata)
    non_tensors = meta.pop("non_tensors", None) or {}
    leaves = meta.pop("leaves", None)
    cls = meta.pop("cls", None)
    cls_metadata = meta.pop("cls_metadata", None) or {}
    meta.pop("size", None)
    if cls != "TensorDict":
        raise VerlDumpError(f"batch is a {describe(cls)}, not a TensorDict")
    if meta:  # what is left are the keys of nested TensorDicts
        raise VerlDumpError(f"batch has nested TensorDicts {describe(list(meta))}; skip stores flat tensors only")
    if non_tensors:
        raise VerlDumpError(f"batch TensorDict has non-tensor entries {describe(non_tensors)}")
    if type(leaves) is not dict:
        raise VerlDumpError("consolidated TensorDict metadata has no leaves")
    tensors = {key: _consolidated_leaf(storage, key, spec) for key, spec in leaves.items()}
    batch_size = cls_metadata.get("batch_size", ()) if type(cls_metadata) is dict else ()
    return TensorDictData(tensors, ints(batch_size, "TensorDict batch size"))


def _consolidated_leaf(storage: torch.Tensor, key: Any, spec: Any) -> torch.Tensor:
    """The tensor ``batch[key]``: its ``(dtype, shape, start, stop, pad)`` slice of the flat storage."""
    if not isinstance(key, str) or key.startswith("<NJT"):
        raise VerlDumpError(f"batch[{describe(key)}] is a nested (jagged) tensor, which skip cannot store")
    if not isinstance(spec, tuple) or len(spec) != 5 or not isinstance(spec[0], str) or spec[0] not in _LEAF_DTYPES:
        raise VerlDumpError(f"batch[{describe(key)}]: bad consolidated leaf {describe(spec)}")
    dtype_name, shape, start, stop, pad = spec
    dtype = _LEAF_DTYPES[dtype_name]
    shape = ints(shape, f"batch[{describe(key)}] shape")
    start, stop = ints((start, stop), f"batch[{describe(key)}] slice")
    nbytes = math.prod(shape) * dtype.itemsize
    size = stop - start
    if stop > len(storage) or size < nbytes or (not pad and size != nbytes) or size % dtype.itemsize:
        raise VerlDumpError(
            f"batch[{describe(key)}]: a {dtype} tensor of shape {shape} ({nbytes} bytes) does not fit bytes "
            f"{start}:{stop} of its {len(storage)}-byte storage"
        )
    charge(nbytes, f"batch[{describe(key)}], a {dtype} tensor of shape {shape}")
    return storage[start:stop].view(dtype)[: math.prod(shape)].view(shape)


def _make_td(cls: Any, state: Any) -> TensorDictData:
    """tensordict's ``_make_td(TensorDict, state)``: an unconsolidated TensorDict's ``__dict__``."""
    if cls is not TensorDictClass or type(state) is not dict:  # the class, as find_class returned it
        raise VerlDumpError(f"unexpected TensorDict reduction of {describe(cls)}")
    tensors = state.get("_tensordict") or {}
    if type(tensors) is not dict:
        raise VerlDumpError("TensorDict without its tensors")
    tensors = {key: tensor_of(value, f"batch[{describe(key)}]") for key, value in tensors.items()}
    return TensorDictData(tensors, ints(state.get("_batch_size") or (), "TensorDict batch size"))


class StorageType(StandIn):
    """A storage class of torch as ``find_class`` returns it: all a storage record needs is its dtype."""

    __slots__ = ("dtype",)

    def __new__(cls, dtype: torch.dtype) -> StorageType:
        self = object.__new__(cls)
        object.__setattr__(self, "dtype", dtype)
        return self


class _Storage(StandIn):
    """One ``data/{key}`` record of a torch zip archive, read as bytes (a stand-in: ``persistent_load``
    puts it on the pickle's stack, where BUILD would set a plain object's attributes)."""

    __slots__ = ("_flat", "data", "dtype")

    def __new__(cls, data: bytearray, dtype: torch.dtype) -> _Storage:
        self = object.__new__(cls)
        for name, value in (("data", data), ("dtype", dtype), ("_flat", {})):
            object.__setattr__(self, name, value)
        return self

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


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None) -> PickledTensor:
    """torch's ``_rebuild_tensor_v2``, on a storage record read by ``TorchZipUnpickler``."""
    return _view(storage, None, offset, size, stride, hooks, metadata)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None) -> PickledTensor:
    """torch's ``_rebuild_tensor_v3`` (dtypes without a legacy storage class, e.g. uint16)."""
    if not isinstance(dtype, torch.dtype):
        raise VerlDumpError(f"tensor rebuilt as {describe(dtype)}, which is not a torch dtype")
    return _view(storage, dtype, offset, size, stride, hooks, metadata)


def _view(storage: Any, dtype: torch.dtype | None, offset, size, stride, hooks, metadata) -> PickledTensor:
    """The tensor a rebuild describes: a view of its storage read as ``dtype``, every element it
    addresses inside the storage, and no more elements than the storage holds."""
    if not isinstance(storage, _Storage):
        raise VerlDumpError("tensor rebuilt from something that is not a storage")
    if hooks or metadata:
        raise VerlDumpError("tensor with backward hooks or tensor metadata")
    size, stride = ints(size, "tensor shape"), ints(stride, "tensor strides")
    (offset,) = ints((offset,), "tensor offset")
    if len(size) != len(stride):
        raise VerlDumpError(f"a tensor of shape {size} with strides {stride}")
    flat = storage.flat(dtype)
    numel = math.prod(size)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if (numel and last >= len(flat)) or numel > len(flat):
        raise VerlDumpError(
            f"a tensor of shape {size}, strides {stride} and offset {offset} addresses more than its "
            f"{len(flat)}-element storage holds"
        )
    charge(numel * flat.element_size(), f"a {flat.dtype} tensor of shape {size}")
    return PickledTensor(torch.as_strided(flat, size, stride, offset))


def torch_size(dims: Any) -> torch.Size:
    """``torch.Size(dims)``, for a list of non-negative ints only."""
    return torch.Size(ints(dims, "torch.Size"))


def _device(kind: Any, index: Any = None) -> torch.device:
    """``torch.device`` as torch pickles one: a type name, and an index or none."""
    if not isinstance(kind, str) or len(kind) > 64 or not (index is None or type(index) is int):
        raise VerlDumpError(f"refusing torch.device({describe(kind)}, {describe(index)})")
    return torch.device(kind) if index is None else torch.device(kind, index)


def ordered_dict() -> dict:
    """``collections.OrderedDict()`` as torch.save writes a tensor's (empty) backward hooks: a
    plain dict, which pickle then fills (an OrderedDict has a ``__dict__`` that BUILD could set)."""
    return {}


class TorchZipUnpickler(RestrictedUnpickler):
    """``data.pkl`` of the ``torch.save`` archive of ``DataProto.batch``; storages come from the archive."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): _consolidated_td,
            ("tensordict._reductions", "_make_td"): _make_td,
            ("tensordict._td", "TensorDict"): TensorDictClass,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
            ("torch", "Size"): torch_size,
            ("torch", "device"): _device,
            ("collections", "OrderedDict"): ordered_dict,
            **{("torch", name): StorageType(DTYPES[dtype]) for name, dtype in LEGACY_STORAGES.items()},
            ("torch.storage", "UntypedStorage"): StorageType(torch.uint8),  # with _rebuild_tensor_v3
            **{("torch", name): dtype for name, dtype in DTYPES.items()},
        }
    )

    def __init__(self, archive: _Archive, prefix: str) -> None:
        super().__init__(bytes(archive.read(f"{prefix}/data.pkl")), archive.where)
        self.archive = archive
        self.prefix = prefix
        self.storages: dict[str, _Storage] = {}

    def persistent_load(self, pid: Any) -> Any:
        """``torch.save``'s reference to a storage record: ``("storage", type, key, location, numel)``."""
        if not isinstance(pid, tuple) or len(pid) != 5:
            raise UnsafePickleError(f"refusing persistent id {describe(pid)} in {printable(self.where)}")
        kind, storage_type, key, _location, numel = pid
        kind = kind.decode("ascii", "replace") if isinstance(kind, bytes) else kind
        if kind != "storage" or not isinstance(storage_type, StorageType) or not isinstance(key, str):
            raise UnsafePickleError(f"refusing persistent id {describe(pid)} in {printable(self.where)}")
        (numel,) = ints((numel,), "storage size")
        if key not in self.storages:  # tensors sharing a storage reference it once each
            self.storages[key] = self._read_storage(key, storage_type.dtype, numel)
        return self.storages[key]

    def _read_storage(self, key: str, dtype: torch.dtype, numel: int) -> _Storage:
        """The record ``data/{key}``, which must hold exactly ``numel`` elements of ``dtype``."""
        name = f"{self.prefix}/data/{key}"
        info = self.archive.info(name)
        if info.file_size != numel * dtype.itemsize:
            raise VerlDumpError(
                f"storage record {printable(name)} has {info.file_size} bytes, expected {numel * dtype.itemsize}"
            )
        return _Storage(self.archive.read(name, f"storage record {name}"), dtype)


class _Archive:
    """A torch zip archive whose records' declared sizes are checked against its real size."""

    def __init__(self, source: BinaryIO, where: str) -> None:
        self.source = source
        self.size = source.seek(0, io.SEEK_END)
        self.where = where
        source.seek(0)
        self.zip = zipfile.ZipFile(source)

    def info(self, name: str) -> zipfile.ZipInfo:
        """A record stored as torch stores it (uncompressed), its bytes inside the archive."""
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise VerlDumpError(f"{printable(self.where)} lacks the record {printable(name)}") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise VerlDumpError(
                f"{printable(self.where)}: record {printable(name)} is compressed, which torch.save never does"
            )
        self.source.seek(info.header_offset)
        header = self.source.read(zipfile.sizeFileHeader)
        fields = struct.unpack(zipfile.structFileHeader, header) if len(header) == zipfile.sizeFileHeader else None
        # signature, versions, flags, method, time, date, crc, sizes, name and extra lengths
        if fields is None or fields[0] != zipfile.stringFileHeader or fields[4] != zipfile.ZIP_STORED:
            raise VerlDumpError(f"{printable(self.where)}: record {printable(name)} has no local header where declared")
        sizes_here = not fields[3] & 0x08  # else a data descriptor after the data gives them, as torch writes
        start = info.header_offset + zipfile.sizeFileHeader + fields[10] + fields[11]
        if (sizes_here and (fields[8], fields[9]) != (info.compress_size, info.file_size)) or (
            info.compress_size != info.file_size or start + info.compress_size > self.size
        ):
            raise VerlDumpError(
                f"{printable(self.where)}: record {printable(name)} declares {info.file_size} bytes at byte {start} "
                f"(local header: {fields[8]}), which its {self.size}-byte archive does not hold"
            )
        return info

    def read(self, name: str, what: str | None = None) -> bytearray:
        """The bytes of the record ``name``, checked (``info``) and, when ``what`` names them, charged."""
        info = self.info(name)
        if what is not None:
            charge(info.file_size, printable(what))
        data = bytearray(info.file_size)
        with self.zip.open(info) as f:  # checks the record's CRC once read through
            view, done = memoryview(data), 0
            while done < len(data) and (n := f.readinto(view[done : done + _CHUNK])):
                done += n
            if done != len(data) or f.read(1):
                raise VerlDumpError(f"{printable(self.where)}: record {printable(name)} is cut short")
        return data


def load_torch_archive(source: bytes | BinaryIO, where: str, unpickler: type | None = None) -> Any:
    """What ``torch.load`` would return for ``source`` (the bytes, or an open file, of a
    ``torch.save`` archive), through ``unpickler`` only (a ``TorchZipUnpickler``, by default this one)."""
    source = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        archive = _Archive(source, where)
    except Exception as exc:  # zipfile's BadZipFile, and what its parsing of a hostile directory raises
        raise VerlDumpError(
            f"{printable(where)} is not a torch zip archive (legacy torch.save formats are not supported): "
            f"{describe_error(exc)}"
        ) from None
    try:
        pickles = [n for n in archive.zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise VerlDumpError(
                f"{printable(where)} is not a torch.save archive (data.pkl records: {describe(pickles)})"
            )
        prefix = pickles[0].removesuffix("/data.pkl")
        if f"{prefix}/byteorder" in archive.zip.namelist():
            order = archive.read(f"{prefix}/byteorder").decode("ascii", "replace")
            if order != sys.byteorder:
                raise VerlDumpError(f"{printable(where)} was written on a {describe(order)}-endian machine")
        reader = (unpickler or TorchZipUnpickler)(archive, prefix)
    except (UnsafePickleError, VerlDumpError):
        raise
    except Exception as exc:  # a record zipfile cannot read: a bad CRC, a name that differs in its header
        raise VerlDumpError(f"{printable(where)}: {describe_error(exc)}") from None
    return reader.load()
