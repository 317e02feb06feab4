"""Decode verl's ``tq_batch.pt`` (the V1 trainer's ``rollout_tq`` dumps) without running code from it.

verl 0.9.1's ``RolloutTqSkip.prepare_data`` writes ``torch.save({"tensordict", "tags", "keys",
"global_steps"})``: the trajectories read back from TransferQueue as a TensorDict (``_make_td``
of its ``__getstate__``) whose fields are tensors, jagged nested tensors (``_rebuild_njt`` of
their values and offsets, through ``_rebuild_from_type_v2``, with torch.compile's dynamic-shape
marks as state) and tensordict's ``NonTensorData`` / ``NonTensorStack`` (one Python value, or
one per row), plus the keys and tags of the rows.

The archive is read by ``torch_archive``'s restricted unpickler, extended here with stand-ins
for those globals that only collect data: no tensordict or torch constructor runs, the
dynamic-shape marks are dropped, and a jagged tensor is rebuilt from checked values and offsets.
Anything else in the file is refused, naming the global.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from skip_core import reading
from skip_core.batch import Batch

from skip_plugin_verl.restricted_pickle import Sealed, UnsafePickleError, VerlDumpError, numpy_globals, sealed
from skip_plugin_verl.tensordicts import PROMPT, to_batch
from skip_plugin_verl.torch_archive import TensorDictData, _TensorDictClass, _TorchZipUnpickler, load_torch_archive

TQ_DUMP = "tq_batch.pt"


class _Inert:
    """An object pickle builds (``NEWOBJ`` then ``BUILD``) that keeps its state and does nothing."""

    def __new__(cls, *args: Any) -> _Inert:
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "state", state)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {name!r} on {type(self).__name__}")


class _NonTensorData(_Inert, metaclass=Sealed):
    """Stands in for ``tensordict.tensorclass.NonTensorData``: one Python value."""


class _NonTensorStack(_Inert, metaclass=Sealed):
    """Stands in for ``tensordict.tensorclass.NonTensorStack``: one ``NonTensorData`` per row."""


class _DimRange(_Inert, metaclass=Sealed):
    """Stands in for torch.compile's ``_DimRange`` mark on a tensor: dropped."""


class _TensorClass(metaclass=Sealed):
    """Stands in for ``torch.Tensor`` as the type argument of ``_rebuild_from_type_v2``."""


class _NestedTensorClass(metaclass=Sealed):
    """Stands in for torch's ``NestedTensor`` class, likewise."""


def _rebuild_from_type(function: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's ``_rebuild_from_type_v2`` without its state: the state holds only torch.compile marks."""
    if new_type not in (_TensorClass, _NestedTensorClass) or not isinstance(args, tuple) or not callable(function):
        raise VerlDumpError(f"unexpected tensor rebuild of {new_type!r}")
    return function(*args)


def _rebuild_njt(arguments: Any) -> torch.Tensor:
    """torch's ``_rebuild_njt``: a jagged tensor from values and offsets, both checked."""
    if not isinstance(arguments, Mapping):
        raise VerlDumpError("nested tensor rebuilt without its arguments")
    values, offsets = arguments.get("values"), arguments.get("offsets")
    if arguments.get("lengths") is not None or arguments.get("_ragged_idx", 1) != 1:
        raise VerlDumpError("nested tensor with holes or ragged in another dim than 1")
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor) or values.dim() < 1:
        raise VerlDumpError("nested tensor without tensor values and offsets")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) < 2:
        raise VerlDumpError("nested tensor offsets are not a 1-d int64 tensor")
    if offsets[0] != 0 or offsets[-1] != len(values) or bool((offsets.diff() < 0).any()):
        raise VerlDumpError("nested tensor offsets do not split its values into rows")
    return torch.nested.nested_tensor_from_jagged(values.clone(), offsets.clone())


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes (a numpy scalar's): latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise VerlDumpError(f"unexpected bytes encoding {encoding!r}")
    return text.encode("latin1")


def _make_td(cls: Any, state: Any) -> Any:
    """tensordict's ``_make_td``: a TensorDict's fields, or a stack of non-tensor values."""
    if not isinstance(state, Mapping):
        raise VerlDumpError(f"unexpected reduction of {cls!r}")
    if cls is _NonTensorStack:
        stack = _NonTensorStack()
        stack.__setstate__(state)
        return stack
    if cls is not _TensorDictClass:
        raise VerlDumpError(f"unexpected reduction of {cls!r}")
    fields = state.get("_tensordict") or {}
    if not isinstance(fields, Mapping):
        raise VerlDumpError("TensorDict without fields")
    batch_size = state.get("_batch_size") or ()
    return TensorDictData(dict(fields), tuple(int(n) for n in batch_size))


class _TqUnpickler(_TorchZipUnpickler):
    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            **_TorchZipUnpickler.allowed,
            ("tensordict._reductions", "_make_td"): _make_td,
            ("tensordict.tensorclass", "NonTensorData"): _NonTensorData,
            ("tensordict.tensorclass", "NonTensorStack"): _NonTensorStack,
            ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
            ("torch.nested._internal.nested_tensor", "_rebuild_njt"): _rebuild_njt,
            ("torch.nested._internal.nested_tensor", "NestedTensor"): _NestedTensorClass,
            ("torch", "Tensor"): _TensorClass,
            ("torch._dynamo.decorators", "_DimRange"): _DimRange,
            ("__builtin__", "set"): set,
            ("builtins", "set"): set,
            ("_codecs", "encode"): _latin1,
            **numpy_globals(),  # the dataset's fields as numpy scalars and arrays
        }
    )


def read_tq_batch(path: str | os.PathLike) -> tuple[Batch, int]:
    """One ``tq_batch.pt`` as a skip ``Batch`` of trajectories (keys and tags as columns, the
    prompt of each row unknown) and the step verl recorded; ``VerlDumpError`` /
    ``UnsafePickleError`` / ``UnsafeFile`` naming what is not verl's format."""
    where = str(path)
    with reading.opened(path) as fd, os.fdopen(os.dup(fd), "rb") as f:  # a regular file, not a link or pipe
        payload = load_torch_archive(f, where, _TqUnpickler)
    if not isinstance(payload, dict) or not {"tensordict", "tags", "keys"} <= set(payload):
        raise VerlDumpError(f"{where} is not verl's rollout_tq dump (tensordict, tags, keys)")
    data, keys, tags = payload["tensordict"], payload["keys"], payload["tags"]
    if not isinstance(data, TensorDictData) or not isinstance(keys, list) or not isinstance(tags, list):
        raise VerlDumpError(f"{where}: tensordict, keys or tags of the wrong type")
    if not all(isinstance(k, str) for k in keys) or not all(isinstance(t, dict) for t in tags):
        raise VerlDumpError(f"{where}: keys that are not strings or tags that are not dicts")
    step = payload.get("global_steps")
    fields = {name: _field(name, value, len(keys)) for name, value in data.tensors.items()}
    return to_batch(_Fields(fields), keys, tags, [None] * len(keys)), step if isinstance(step, int) else -1


class _Fields(dict):
    """The decoded fields, read by ``tensordicts.to_batch`` as a TensorDict's ``items()``."""


def _field(name: str, value: Any, rows: int) -> Any:
    from tensordict import NonTensorData, NonTensorStack

    if isinstance(value, torch.Tensor):
        if len(value) != rows:
            raise VerlDumpError(f"field {name!r} has {len(value)} rows, the dump has {rows} keys")
        return value
    if isinstance(value, _NonTensorData):
        return NonTensorData(_data(name, value))
    if isinstance(value, _NonTensorStack):
        items = value.state.get("tensordicts") if isinstance(value.state, Mapping) else None
        if not isinstance(items, list) or len(items) != rows or not all(isinstance(i, _NonTensorData) for i in items):
            raise VerlDumpError(f"field {name!r} is not a stack of {rows} non-tensor values")
        return NonTensorStack(*(_data(name, item) for item in items))
    raise VerlDumpError(f"field {name!r} is a {type(value).__name__}, which a skip entry cannot store")


def _data(name: str, item: _NonTensorData) -> Any:
    state = getattr(item, "state", None)
    values = state.get("non_tensordict") if isinstance(state, Mapping) else None
    if not isinstance(values, Mapping) or "data" not in values:
        raise VerlDumpError(f"field {name!r}: a non-tensor value without its data")
    return values["data"]


__all__ = ["PROMPT", "TQ_DUMP", "read_tq_batch"]
