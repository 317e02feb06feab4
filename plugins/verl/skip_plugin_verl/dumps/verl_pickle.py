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
levels are read by ``RestrictedUnpickler`` subclasses (``restricted_pickle.py``) whose
``find_class`` resolves only the globals listed here and in ``torch_archive.py``, each a
stand-in that only collects data: verl's ``DataProto``, numpy's array, dtype and scalar
reconstruction (``numpy_pickle.py``), ``torch.Size``, and tensordict's rebuild functions
(tensors are rebuilt from the archive's raw storage records). Any other global is refused with
an ``UnsafePickleError`` naming it, and what ``find_class`` returns cannot be modified through
pickle's BUILD opcode. ``non_tensor_batch`` and ``meta_info`` are then rebuilt from plain values
only (``plain_values.py``). Every size the file declares is charged against a budget
proportional to its size (``budget.py``), and whatever else goes wrong is one ``VerlDumpError``
or ``UnsafePickleError`` line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from skip_core import reading
from skip_core.batch import Batch

from skip_plugin_verl.dumps import budget
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.numpy_pickle import PickledArray, numpy_globals
from skip_plugin_verl.dumps.plain_values import plain
from skip_plugin_verl.dumps.restricted_pickle import (
    DTYPES,
    RestrictedUnpickler,
    StandIn,
    describe,
    ints,
    reader_errors,
    sealed,
)
from skip_plugin_verl.dumps.torch_archive import TensorDictData, load_torch_archive, ordered_dict, torch_size

__all__ = ["read_gen_batch"]

_UNSET = object()


class _DataProtoState(StandIn):
    """Stands in for ``verl.protocol.DataProto``: keeps the state ``__setstate__`` receives, once."""

    __slots__ = ("state",)

    def __new__(cls) -> _DataProtoState:
        self = object.__new__(cls)
        object.__setattr__(self, "state", _UNSET)
        return self

    def __setstate__(self, state: Any) -> None:
        if self.state is not _UNSET:
            raise UnsafePickleError("refusing a second state for DataProto")
        object.__setattr__(self, "state", state)


class _OuterUnpickler(RestrictedUnpickler):
    """The ``gen_batch.dp`` pickle: a DataProto whose state holds numpy data and bytes."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            ("verl.protocol", "DataProto"): _DataProtoState,
            ("torch", "Size"): torch_size,  # VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
            ("collections", "OrderedDict"): ordered_dict,
            **numpy_globals(),
        }
    )


def _decode_numpy_batch(state: Any) -> TensorDictData:
    """The batch as ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` writes it."""
    if not isinstance(state, tuple) or len(state) != 3 or type(state[2]) is not dict:
        raise VerlDumpError("batch is neither torch.save bytes nor verl's numpy serialization")
    batch_size, _device, items = state
    tensors = {}
    for key, value in items.items():
        if not isinstance(value, tuple) or len(value) != 3:
            raise VerlDumpError(f"batch[{describe(key)}] is a nested tensor, which skip cannot store")
        dtype_name, shape, data = value
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        shape = ints(shape, f"batch[{describe(key)}] shape")
        raw = data.numeric(f"batch[{describe(key)}]") if isinstance(data, PickledArray) else None
        nbytes = math.prod(shape) * dtype.itemsize if dtype is not None else None
        if raw is None or raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != nbytes:
            raise VerlDumpError(f"batch[{describe(key)}]: bad numpy-serialized tensor ({describe(dtype_name)})")
        budget.charge(raw.size, f"batch[{describe(key)}], a {dtype} tensor of shape {shape}")
        tensors[key] = torch.from_numpy(raw).view(dtype).view(shape)
    return TensorDictData(tensors, ints(batch_size, "batch size"))


def _decode_batch(state: Any, where: str) -> TensorDictData | None:
    """``DataProto.batch`` from its pickled state: ``torch.save`` bytes, ``None``, or verl's numpy form."""
    if state is None:
        return None
    batch = load_torch_archive(state, where) if isinstance(state, bytes) else _decode_numpy_batch(state)
    if batch is not None and not isinstance(batch, TensorDictData):  # torch.save(None) is a DataProto without tensors
        raise VerlDumpError(f"DataProto.batch is a {type(batch).__name__}, not a TensorDict")
    return batch


def _dataproto_state(data: bytes, where: str) -> tuple[Any, Any, Any]:
    """The state verl's ``DataProto.__getstate__`` pickled: ``(batch, non_tensor_batch, meta_info)``."""
    proto = _OuterUnpickler(data, where).load()
    if not isinstance(proto, _DataProtoState):
        raise VerlDumpError(f"holds a {type(proto).__name__}, not a verl DataProto")
    if not isinstance(proto.state, tuple) or len(proto.state) != 3:
        raise VerlDumpError("DataProto state is not verl's (batch, non_tensor_batch, meta_info)")
    return proto.state


def read_gen_batch(path: str | os.PathLike) -> Batch:
    """Decode one verl ``gen_batch.dp`` into a ``Batch`` without running code from it."""
    where = str(path)
    with reading.opened(path) as fd, os.fdopen(os.dup(fd), "rb") as f:  # a regular file, not a link or pipe
        data = f.read()  # once: what is checked is what is unpickled
    with budget.limited(where, len(data)), reader_errors(where):
        batch_state, non_tensors, meta_info = _dataproto_state(data, where)
        del data  # the file's bytes, before the batch's archive is read out of its copy in the pickle
        if type(non_tensors) is not dict or not (meta_info is None or type(meta_info) is dict):
            raise VerlDumpError("DataProto non_tensor_batch/meta_info are not dicts")
        non_tensors = plain(non_tensors, "non_tensor_batch")
        for key, value in non_tensors.items():
            if not isinstance(key, str) or not isinstance(value, np.ndarray):
                raise VerlDumpError(f"non_tensor_batch[{describe(key)}] is not a numpy array")
        meta_info = plain(meta_info or {}, "meta_info")
        batch = _decode_batch(batch_state, f"{Path(path)} (DataProto.batch)")
        tensors = batch.tensors if batch is not None else {}
        result = Batch(tensors, non_tensors, meta_info)
        if batch is not None and batch.batch_size and tensors and batch.batch_size[0] != len(result):
            raise VerlDumpError(f"TensorDict batch size {batch.batch_size} disagrees with its tensors")
    return result
