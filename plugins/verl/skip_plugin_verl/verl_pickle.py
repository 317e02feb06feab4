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
``find_class`` resolves only the globals listed here and in ``torch_archive.py`` (numpy's array
reconstruction, ``torch.Size``, and stand-ins for verl's ``DataProto`` and tensordict's rebuild
functions that only collect data; tensors are rebuilt from the archive's raw storage records)
and refuses any other global with an ``UnsafePickleError`` naming it. What ``find_class``
returns cannot be modified through pickle's BUILD opcode.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from skip_core import reading
from skip_core.batch import Batch

from skip_plugin_verl.restricted_pickle import (
    DTYPES,
    RestrictedUnpickler,
    Sealed,
    UnsafePickleError,
    VerlDumpError,
    numpy_globals,
    sealed,
)
from skip_plugin_verl.torch_archive import TensorDictData, from_bytes, load_torch_archive

__all__ = ["UnsafePickleError", "VerlDumpError", "read_gen_batch"]


class _DataProtoState(metaclass=Sealed):
    """Stands in for ``verl.protocol.DataProto``: keeps the state ``__setstate__`` receives."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _OuterUnpickler(RestrictedUnpickler):
    """The ``gen_batch.dp`` pickle: a DataProto whose state holds numpy data and bytes."""

    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            ("verl.protocol", "DataProto"): _DataProtoState,
            ("torch", "Size"): torch.Size,  # VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
            ("collections", "OrderedDict"): collections.OrderedDict,
            **numpy_globals(),
        }
    )


def _decode_numpy_batch(state: Any) -> TensorDictData:
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
        flat = from_bytes(bytearray(data.tobytes()), dtype)
        tensors[key] = flat.view(tuple(int(n) for n in shape))
    return TensorDictData(tensors, tuple(int(n) for n in batch_size))


def _decode_batch(state: Any, where: str) -> TensorDictData | None:
    """``DataProto.batch`` from its pickled state: ``torch.save`` bytes, ``None``, or verl's numpy form."""
    if state is None:
        return None
    batch = load_torch_archive(state, where) if isinstance(state, bytes) else _decode_numpy_batch(state)
    if batch is not None and not isinstance(batch, TensorDictData):  # torch.save(None) is a DataProto without tensors
        raise VerlDumpError(f"DataProto.batch is a {type(batch).__name__}, not a TensorDict")
    return batch


def read_gen_batch(path: str | os.PathLike) -> Batch:
    """Decode one verl ``gen_batch.dp`` into a ``Batch`` without running code from it."""
    path = Path(path)
    with reading.opened(path) as fd, os.fdopen(os.dup(fd), "rb") as f:  # a regular file, not a link or pipe
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
