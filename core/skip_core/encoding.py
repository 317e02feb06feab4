"""A ``Batch`` on disk as data only: loading can never execute code.

``tensors.safetensors`` holds ``batch`` (memory-mapped on load); a jagged nested tensor (verl's
TransferQueue trajectories: one ragged row per sample) is kept as its values and offsets under
two suffixed names and comes back jagged. ``data.json`` holds
``non_tensor_batch`` and ``meta_info`` in JSON, with a few tagged forms so numpy dtypes,
shapes, tuples, bytes and non-string dict keys come back as they went in. Anything else is
refused at dump time with the path of the offending value.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

TENSORS = "tensors.safetensors"
DATA = "data.json"

# Non-tensor keys that identify a sample rather than describe it (verl draws ``uid`` at random).
IDENTITY_KEYS = frozenset({"uid"})

_TAG = "__skip__"
# A jagged tensor ``x`` is stored as ``x`` + these: names no safetensors key of ``write``'s has otherwise.
_VALUES, _OFFSETS = "\x1fjagged_values", "\x1fjagged_offsets"
_ARRAY_KINDS = "biufUO"  # bool, ints, floats, unicode, object: all representable in JSON


class EncodingError(ValueError):
    """A value that cannot be stored as data."""


def write(batch: Any, directory: Path) -> list[str]:
    """Write ``batch`` into ``directory``; return the file names written."""
    from safetensors.torch import save_file

    save_file(storable(tensors_of(batch)), str(directory / TENSORS))
    payload = {
        "non_tensor_batch": {k: encode(v, f"non_tensor_batch[{k!r}]") for k, v in batch.non_tensor_batch.items()},
        "meta_info": encode(dict(batch.meta_info), "meta_info"),
    }
    (directory / DATA).write_text(json.dumps(payload, allow_nan=True), encoding="utf-8")
    return [TENSORS, DATA]


def read(directory: Path, payload: Any = None, size: int | None = None) -> Any:
    """Load a batch written by ``write``; tensors stay backed by the memory-mapped file.

    ``payload``: ``data.json`` already read (``CacheStore.load`` reads it bounded and checked),
    ``size`` its bytes; by default it is read here, through ``skip_core.reading``. ``ValueError``
    for anything that is not what ``write`` wrote, or whose arrays would take more memory than
    its size allows (``decode``).
    """
    from safetensors.torch import load_file

    from skip_core import reading
    from skip_core.batch import Batch

    if payload is None:
        size = (directory / DATA).stat().st_size
        payload = reading.read_json(directory / DATA, size)
    budget = _Budget(size or 0)
    try:
        non_tensors = {k: decode(v, budget) for k, v in payload["non_tensor_batch"].items()}
        meta_info = decode(payload.get("meta_info", {}), budget)
    except (KeyError, TypeError, AttributeError, OverflowError) as exc:  # shapes JSON can take that write never gave
        raise ValueError(f"{DATA} does not decode: {exc!r}") from None
    if not isinstance(meta_info, dict) or not all(isinstance(v, np.ndarray) for v in non_tensors.values()):
        raise ValueError(f"{DATA} does not hold a batch's non-tensor data")
    return Batch(_regroup(load_file(str(directory / TENSORS))), non_tensors, meta_info)


def tensors_of(batch: Any) -> dict[str, Any]:
    """``batch.batch`` as a dict: skip's, or verl's TensorDict (``None`` without tensors; iterating one yields rows)."""
    return {} if batch.batch is None else dict(batch.batch.items())


def storable(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """safetensors refuses views sharing storage and non-contiguous tensors: copy just those."""
    seen: set[int] = set()
    out = {}
    for key, tensor in _flat(tensors).items():
        tensor = tensor.detach().cpu()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen or not tensor.is_contiguous() or tensor.storage_offset() or _is_partial(tensor):
            tensor = tensor.contiguous().clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _flat(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Jagged nested tensors as their values and offsets; other tensors as they are."""
    import torch

    out = {}
    for key, tensor in tensors.items():
        if not tensor.is_nested:
            out[key] = tensor
        elif tensor.layout != torch.jagged or tensor._ragged_idx != 1 or tensor.lengths() is not None:
            raise EncodingError(f"batch[{key!r}]: only jagged tensors ragged in dim 1, with no holes, are stored")
        else:
            out[key + _VALUES], out[key + _OFFSETS] = tensor.values(), tensor.offsets()
    return out


def _regroup(tensors: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``_flat``; ``ValueError`` for values and offsets that do not make a jagged tensor."""
    import torch

    out = {k: v for k, v in tensors.items() if not k.endswith((_VALUES, _OFFSETS))}
    for key in (k[: -len(_VALUES)] for k in tensors if k.endswith(_VALUES)):
        values, offsets = tensors[key + _VALUES], tensors.get(key + _OFFSETS)
        if offsets is None or offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) < 2 or key in out:
            raise ValueError(f"batch[{key!r}]: jagged values without their int64 offsets")
        if offsets[0] != 0 or offsets[-1] != len(values) or bool((offsets.diff() < 0).any()) or values.dim() < 1:
            raise ValueError(f"batch[{key!r}]: offsets that do not split its values into rows")
        out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    if len(out) + sum(1 for k in tensors if k.endswith(_VALUES)) != len(tensors):
        raise ValueError("jagged offsets without their values")
    return out


def _is_partial(tensor: Any) -> bool:
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def encode(value: Any, where: str) -> Any:
    """A JSON-ready form of ``value``; ``where`` names it in errors."""
    if isinstance(value, np.ndarray):
        return _encode_array(value, where)
    if isinstance(value, np.generic):  # before the builtins: np.float64 is a float, np.str_ a str
        return {_TAG: "scalar", "dtype": value.dtype.str, "value": encode(value.item(), where)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise EncodingError(f"{where}: cannot store a value of type {type(value).__name__} as data")


def _encode_array(array: np.ndarray, where: str) -> dict:
    if array.dtype.kind not in _ARRAY_KINDS:
        raise EncodingError(f"{where}: cannot store numpy dtype {array.dtype}")
    if array.dtype.kind == "O":
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(array.ravel())]
    else:
        items = array.ravel().tolist()
    return {_TAG: "ndarray", "dtype": array.dtype.str, "shape": list(array.shape), "items": items}


class _Budget:
    """The bytes of arrays a JSON text of ``size`` bytes may declare: a dtype names its item size
    (``<U100000000`` is 400 MB an item), so 31 KB of items could ask for gigabytes."""

    def __init__(self, size: int) -> None:
        from skip_core.reading import JSON_AMPLIFICATION, JSON_FLOOR

        self.size = size
        self.limit = self.left = max(JSON_AMPLIFICATION * size, JSON_FLOOR)

    def take(self, dtype: np.dtype, count: int) -> None:
        self.left -= dtype.itemsize * count
        if self.left < 0:
            raise ValueError(
                f"its arrays (the last: {count} items of {dtype.str}) declare more than the {self.limit} bytes "
                f"allowed for its {self.size} bytes"
            )


def decode(value: Any, budget: _Budget | None = None) -> Any:
    """Inverse of ``encode``; raises ``ValueError`` on anything it did not produce, and on arrays
    declaring more bytes than ``budget`` (by default ``reading.JSON_FLOOR``) allows."""
    budget = _Budget(0) if budget is None else budget
    if isinstance(value, list):
        return [decode(v, budget) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode(v, budget) for k, v in value.items()}
    if tag == "ndarray":
        return _decode_array(value, budget)
    if tag == "scalar":
        return np.dtype(_dtype(value["dtype"])).type(value["value"])
    if tag == "tuple":
        return tuple(decode(v, budget) for v in value["items"])
    if tag == "bytes":
        return base64.b64decode(value["base64"], validate=True)
    if tag == "dict":
        return {_hashable(decode(k, budget)): decode(v, budget) for k, v in value["items"]}
    raise ValueError(f"unknown tag {tag!r}")


def _decode_array(value: dict, budget: _Budget) -> np.ndarray:
    dtype = _dtype(value["dtype"])
    shape = tuple(int(n) for n in value["shape"])
    items = value["items"]
    if not isinstance(items, list):
        raise ValueError(f"array items are a {type(items).__name__}, not a list")
    budget.take(dtype, len(items))  # before numpy allocates a byte
    if dtype.kind == "O":
        array = np.empty(len(items), dtype=object)
        for i, item in enumerate(items):
            array[i] = decode(item, budget)
    else:
        array = np.array(items, dtype=dtype)
    return array.reshape(shape)


def _dtype(text: str) -> np.dtype:
    dtype = np.dtype(text)  # a dtype string cannot name a Python class: safe to parse
    if dtype.kind not in _ARRAY_KINDS:
        raise ValueError(f"dtype {text!r} is not allowed")
    return dtype


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def fingerprint(batch: Any) -> str | None:
    """A content hash of the inputs a result was generated from; ``None`` for non-batches and
    inputs that cannot be stored as data.

    Covers every tensor (name, dtype, shape, bytes) and every non-tensor except identity
    keys; ``meta_info`` is excluded, as it carries bookkeeping such as the step.
    """
    others = getattr(batch, "non_tensor_batch", None)
    if not hasattr(batch, "batch") or not isinstance(others, Mapping):
        return None
    import torch

    digest = xxhash.xxh3_128()
    try:
        tensors = _flat(tensors_of(batch))
        for key in sorted(tensors):
            tensor = tensors[key].detach().cpu().contiguous()
            digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
        for key in sorted(k for k in others if k not in IDENTITY_KEYS):
            digest.update(json.dumps([key, encode(others[key], key)], sort_keys=True).encode())
    except EncodingError:  # e.g. images: such inputs go unchecked rather than fail the step
        return None
    return digest.hexdigest()
