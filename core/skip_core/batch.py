"""``Batch``: the container one RL step passes around, shaped like verl's DataProto.

``batch`` maps names to torch tensors sharing the first (sample) dimension;
``non_tensor_batch`` maps names to numpy arrays of the same length (``dtype=object`` holds
strings, dicts, lists); ``meta_info`` is a plain dict for the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch


class Batch:
    def __init__(
        self,
        batch: Mapping[str, torch.Tensor] | None = None,
        non_tensor_batch: Mapping[str, np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> None:
        self.batch: dict[str, torch.Tensor] = dict(batch or {})
        self.non_tensor_batch: dict[str, np.ndarray] = dict(non_tensor_batch or {})
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self.check_consistency()

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a batch; non-tensor values that are lists become 1-d object arrays."""
        return cls(tensors, {k: _as_array(v) for k, v in (non_tensors or {}).items()}, meta_info)

    def check_consistency(self) -> None:
        sizes = {f"batch[{k!r}]": len(v) for k, v in self.batch.items() if _check_tensor(k, v)}
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}]: expected a numpy array, got {type(value).__name__}")
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}]: expected at least one dimension")
            sizes[f"non_tensor_batch[{key!r}]"] = len(value)
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{k}: {n}" for k, n in sizes.items())
            raise ValueError(f"batch entries disagree on the number of samples ({detail})")

    def __len__(self) -> int:
        for value in self.batch.values():
            return len(value)
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.batch.items())
        others = ", ".join(self.non_tensor_batch)
        meta = list(self.meta_info)
        return f"Batch(len={len(self)}, batch={{{tensors}}}, non_tensor_batch=[{others}], meta_info={meta})"

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows by int, slice, index list/array or boolean mask; always returns a ``Batch``."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        np_index = index.numpy() if isinstance(index, torch.Tensor) else index
        t_index = torch.as_tensor(index) if not isinstance(index, slice) else index
        return Batch(
            {k: v[t_index] for k, v in self.batch.items()},
            {k: v[np_index] for k, v in self.non_tensor_batch.items()},
            self.meta_info,
        )

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A batch with only the named keys (``None`` keeps every key of that part)."""
        return Batch(
            _pick(self.batch, batch_keys, "batch"),
            _pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
            _pick(self.meta_info, meta_info_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_batch_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> Batch:
        """Remove the named keys from this batch and return them as a new batch."""
        popped = self.select(batch_keys, non_tensor_batch_keys, meta_info_keys)
        for key in popped.batch:
            del self.batch[key]
        for key in popped.non_tensor_batch:
            del self.non_tensor_batch[key]
        for key in popped.meta_info:
            del self.meta_info[key]
        return popped

    def union(self, other: Batch) -> Batch:
        """Merge ``other`` into this batch in place; a key present in both must be equal."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} samples")
        for key, value in other.batch.items():
            if key in self.batch and not torch.equal(self.batch[key], value):
                raise ValueError(f"union: batch[{key!r}] differs between the two batches")
            self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            mine = self.non_tensor_batch.get(key)
            if mine is not None and not _same_array(mine, value):
                raise ValueError(f"union: non_tensor_batch[{key!r}] differs between the two batches")
            self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and self.meta_info[key] != value:
                raise ValueError(f"union: meta_info[{key!r}] differs between the two batches")
            self.meta_info[key] = value
        return self

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> Batch:
        """Repeat every sample; ``interleave`` gives a,a,b,b (GRPO groups) instead of a,b,a,b."""
        if interleave:
            tensors = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            others = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            tensors = {k: v.repeat(repeat_times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            others = {k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return Batch(tensors, others, self.meta_info)

    def chunk(self, chunks: int) -> list[Batch]:
        """Split into ``chunks`` parts of equal size; the length must divide evenly."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(f"cannot split {len(self)} samples into {chunks} equal chunks")
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along samples; ``meta_info`` is taken from the first batch."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for other in batches[1:]:
            if (
                other.batch.keys() != first.batch.keys()
                or other.non_tensor_batch.keys() != first.non_tensor_batch.keys()
            ):
                raise ValueError("concat: batches have different keys")
        return Batch(
            {k: torch.cat([b.batch[k] for b in batches]) for k in first.batch},
            {k: np.concatenate([b.non_tensor_batch[k] for b in batches]) for k in first.non_tensor_batch},
            first.meta_info,
        )

    def equals(self, other: Batch) -> bool:
        """Same keys, dtypes, shapes and values in every part."""
        return (
            self.batch.keys() == other.batch.keys()
            and all(
                self.batch[k].dtype == other.batch[k].dtype and torch.equal(self.batch[k], other.batch[k])
                for k in self.batch
            )
            and self.non_tensor_batch.keys() == other.non_tensor_batch.keys()
            and all(_same_array(self.non_tensor_batch[k], other.non_tensor_batch[k]) for k in self.non_tensor_batch)
            and _same_value(self.meta_info, other.meta_info)
        )


def _check_tensor(key: str, value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch[{key!r}]: expected a torch tensor, got {type(value).__name__}")
    if value.dim() == 0:
        raise ValueError(f"batch[{key!r}]: expected at least one dimension")
    return True


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    items = list(value)
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # element-wise: nested lists must stay objects
        array[i] = item
    return array


def _pick(part: Mapping[str, Any], keys: Iterable[str] | None, label: str) -> dict[str, Any]:
    if keys is None:
        return dict(part)
    missing = [k for k in keys if k not in part]
    if missing:
        raise KeyError(f"{label} has no key {missing[0]!r} (keys: {sorted(part)})")
    return {k: part[k] for k in keys}


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype != object:
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    return all(_same_value(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))


def _same_value(a: Any, b: Any) -> bool:
    """Deep equality that handles numpy arrays nested in dicts and lists."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _same_array(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))
