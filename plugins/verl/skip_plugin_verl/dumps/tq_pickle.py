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
Anything else in the file is refused, naming the global. The non-tensor values, keys and tags
are rebuilt from plain values only (``plain_values``), and every size the file declares is
charged to its budget (``budget``), as for ``gen_batch.dp``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from skip_core import reading
from skip_core.batch import Batch
from skip_core.escaping import printable

from skip_plugin_verl.dumps import budget
from skip_plugin_verl.dumps.errors import UnsafePickleError, VerlDumpError
from skip_plugin_verl.dumps.numpy_pickle import numpy_globals
from skip_plugin_verl.dumps.plain_values import plain
from skip_plugin_verl.dumps.restricted_pickle import Marker, StandIn, describe, ints, reader_errors, sealed
from skip_plugin_verl.dumps.torch_archive import (
    PickledTensor,
    TensorDictClass,
    TensorDictData,
    TorchZipUnpickler,
    load_torch_archive,
    tensor_of,
)
from skip_plugin_verl.tensordicts import PROMPT, batch_of

TQ_DUMP = "tq_batch.pt"
_UNSET = object()


class _Inert(StandIn):
    """An object pickle builds (``NEWOBJ`` then ``BUILD``) that keeps its state, once, and does nothing."""

    __slots__ = ("state",)

    def __new__(cls, *args: Any) -> _Inert:
        self = object.__new__(cls)
        object.__setattr__(self, "state", _UNSET)
        return self

    def __setstate__(self, state: Any) -> None:
        if self.state is not _UNSET:
            raise UnsafePickleError(f"refusing a second state for {type(self).__name__}")
        object.__setattr__(self, "state", state)


class _NonTensorData(_Inert):
    """Stands in for ``tensordict.tensorclass.NonTensorData``: one Python value."""

    __slots__ = ()


class _NonTensorStack(_Inert):
    """Stands in for ``tensordict.tensorclass.NonTensorStack``: one ``NonTensorData`` per row."""

    __slots__ = ()


class _DimRange(_Inert):
    """Stands in for torch.compile's ``_DimRange`` mark on a tensor: dropped."""

    __slots__ = ()


class _TensorClass(Marker):
    """Stands in for ``torch.Tensor`` as the type argument of ``_rebuild_from_type_v2``."""


class _NestedTensorClass(Marker):
    """Stands in for torch's ``NestedTensor`` class, likewise."""


def _rebuild_from_type(function: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's ``_rebuild_from_type_v2`` without its state: the state holds only torch.compile marks.
    ``function`` may only be one of the tensor rebuilds this unpickler knows."""
    rebuilds = [_TqUnpickler.allowed[name] for name in _TENSOR_REBUILDS]
    if new_type not in (_TensorClass, _NestedTensorClass) or type(args) is not tuple:
        raise VerlDumpError(f"unexpected tensor rebuild of {describe(new_type)}")
    if not any(function is rebuild for rebuild in rebuilds):
        raise VerlDumpError(f"unexpected tensor rebuild through {describe(function)}")
    return function(*args)


def _rebuild_njt(arguments: Any) -> PickledTensor:
    """torch's ``_rebuild_njt``: a jagged tensor from values and offsets, both checked."""
    if type(arguments) is not dict:
        raise VerlDumpError("nested tensor rebuilt without its arguments")
    values, offsets = arguments.get("values"), arguments.get("offsets")
    if arguments.get("lengths") is not None or arguments.get("_ragged_idx", 1) != 1:
        raise VerlDumpError("nested tensor with holes or ragged in another dim than 1")
    values, offsets = tensor_of(values, "nested tensor values"), tensor_of(offsets, "nested tensor offsets")
    if values.dim() < 1:
        raise VerlDumpError("nested tensor values without a dimension")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) < 2:
        raise VerlDumpError("nested tensor offsets are not a 1-d int64 tensor")
    if offsets[0] != 0 or offsets[-1] != len(values) or bool((offsets.diff() < 0).any()):
        raise VerlDumpError("nested tensor offsets do not split its values into rows")
    budget.charge(values.numel() * values.element_size(), f"a jagged {values.dtype} tensor of {len(values)} values")
    return PickledTensor(torch.nested.nested_tensor_from_jagged(values.clone(), offsets.clone()))


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes (a numpy scalar's): latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise VerlDumpError(f"unexpected bytes encoding {describe(encoding)}")
    return text.encode("latin1")


def _set(items: Any = ()) -> set:
    """``set(items)`` as protocol 2 pickles a set (torch.compile's marks): from a list only."""
    if type(items) not in (list, tuple):
        raise VerlDumpError(f"a set of {describe(items)}")
    return set(items)


def _make_td(cls: Any, state: Any) -> Any:
    """tensordict's ``_make_td``: a TensorDict's fields, or a stack of non-tensor values."""
    if type(state) is not dict:
        raise VerlDumpError(f"unexpected reduction of {describe(cls)}")
    if cls is _NonTensorStack:
        stack = _NonTensorStack()
        stack.__setstate__(state)
        return stack
    if cls is not TensorDictClass:
        raise VerlDumpError(f"unexpected reduction of {describe(cls)}")
    fields = state.get("_tensordict") or {}
    if type(fields) is not dict:
        raise VerlDumpError("TensorDict without fields")
    return TensorDictData(dict(fields), ints(state.get("_batch_size") or (), "TensorDict batch size"))


_TENSOR_REBUILDS = (("torch._utils", "_rebuild_tensor_v2"), ("torch.nested._internal.nested_tensor", "_rebuild_njt"))


class _TqUnpickler(TorchZipUnpickler):
    allowed: ClassVar[Mapping[tuple[str, str], Any]] = sealed(
        {
            **TorchZipUnpickler.allowed,
            ("tensordict._reductions", "_make_td"): _make_td,
            ("tensordict.tensorclass", "NonTensorData"): _NonTensorData,
            ("tensordict.tensorclass", "NonTensorStack"): _NonTensorStack,
            ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
            ("torch.nested._internal.nested_tensor", "_rebuild_njt"): _rebuild_njt,
            ("torch.nested._internal.nested_tensor", "NestedTensor"): _NestedTensorClass,
            ("torch", "Tensor"): _TensorClass,
            ("torch._dynamo.decorators", "_DimRange"): _DimRange,
            ("__builtin__", "set"): _set,
            ("builtins", "set"): _set,
            ("_codecs", "encode"): _latin1,
            **numpy_globals(),  # the dataset's fields as numpy scalars and arrays
        }
    )


@dataclass
class TqDump:
    """A ``tq_batch.pt`` decoded: the trajectories' tensors, their non-tensor fields (one value
    per row, or one for all rows), TransferQueue's keys and tags of the rows, and the step."""

    tensors: dict[str, torch.Tensor]
    stacks: dict[str, list]
    singles: dict[str, Any]
    keys: list[str]
    tags: list[dict]
    step: int


def decode_tq_batch(path: str | os.PathLike) -> TqDump:
    """One ``tq_batch.pt``, decoded to plain values and tensors; ``VerlDumpError`` /
    ``UnsafePickleError`` / ``UnsafeFile`` naming what is not verl's format."""
    where = str(path)
    with (
        reading.opened(path) as fd,  # a regular file, not a link or pipe
        os.fdopen(os.dup(fd), "rb") as f,
        budget.limited(where, os.fstat(fd).st_size),
        reader_errors(where),
    ):
        payload = load_torch_archive(f, where, _TqUnpickler)
        if type(payload) is not dict or not {"tensordict", "tags", "keys"} <= set(payload):
            raise VerlDumpError(f"{printable(where)} is not verl's rollout_tq dump (tensordict, tags, keys)")
        data = payload["tensordict"]
        keys, tags = plain(payload["keys"], "keys"), plain(payload["tags"], "tags")
        if not isinstance(data, TensorDictData) or type(keys) is not list or type(tags) is not list:
            raise VerlDumpError(f"{printable(where)}: tensordict, keys or tags of the wrong type")
        if not all(type(k) is str for k in keys) or not all(type(t) is dict for t in tags):
            raise VerlDumpError(f"{printable(where)}: keys that are not strings or tags that are not dicts")
        step = payload.get("global_steps")
        dump = TqDump({}, {}, {}, keys, tags, step if type(step) is int else -1)
        for name, value in data.tensors.items():
            _field(dump, name, value)
    return dump


def _field(dump: TqDump, name: Any, value: Any) -> None:
    """The field ``name`` of the trajectories, into ``dump`` by its kind."""
    rows = len(dump.keys)
    if type(name) is not str:
        raise VerlDumpError(f"field {describe(name)} is not named by a string")
    if isinstance(value, PickledTensor):
        if len(value.tensor) != rows:
            raise VerlDumpError(f"field {describe(name)} has {len(value.tensor)} rows, the dump has {rows} keys")
        dump.tensors[name] = value.tensor
    elif isinstance(value, _NonTensorData):
        dump.singles[name] = plain(_data(name, value), f"field {describe(name)}")
    elif isinstance(value, _NonTensorStack):
        items = value.state.get("tensordicts") if type(value.state) is dict else None
        if type(items) is not list or len(items) != rows or not all(isinstance(i, _NonTensorData) for i in items):
            raise VerlDumpError(f"field {describe(name)} is not a stack of {rows} non-tensor values")
        dump.stacks[name] = plain([_data(name, item) for item in items], f"field {describe(name)}")
    else:
        raise VerlDumpError(f"field {describe(name)} is a {type(value).__name__}, which a skip entry cannot store")


def _data(name: str, item: _NonTensorData) -> Any:
    values = item.state.get("non_tensordict") if type(item.state) is dict else None
    if type(values) is not dict or "data" not in values:
        raise VerlDumpError(f"field {describe(name)}: a non-tensor value without its data")
    return values["data"]


def read_tq_batch(path: str | os.PathLike) -> tuple[Batch, int]:
    """One ``tq_batch.pt`` as a skip ``Batch`` of trajectories (keys and tags as columns, the
    prompt of each row unknown) and the step verl recorded (``decode_tq_batch``)."""
    dump = decode_tq_batch(path)
    with reader_errors(str(path)):  # a field named as skip's own columns, fields of other lengths
        batch = batch_of(dump.tensors, dump.stacks, dump.singles, dump.keys, dump.tags, [None] * len(dump.keys))
    return batch, dump.step


__all__ = ["PROMPT", "TQ_DUMP", "TqDump", "decode_tq_batch", "read_tq_batch"]
