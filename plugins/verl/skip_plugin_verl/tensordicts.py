"""verl's TransferQueue trajectories as skip batches, and back: data only, nothing pickled.

A ``TensorDict`` read from TransferQueue holds three kinds of field: tensors (one row per
trajectory), jagged nested tensors (``prompts``, ``responses``… of ragged length, as the agent
loop writes them) and ``NonTensorStack`` values (the dataset's fields, ``extra_fields``, one
Python value per row); a ``NonTensorData`` holds one value for all rows. In a skip ``Batch`` the
tensors stay tensors (skip's store keeps jagged ones as values and offsets), the stacks become
object arrays stored as JSON, and the single values go in ``meta_info``. TransferQueue's key and
tags of each row ride along as two more columns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
from skip_core.batch import Batch
from skip_core.encoding import encode

KEY, TAGS, PROMPT = "__tq_key__", "__tq_tags__", "__tq_prompt__"
COLUMNS = (KEY, TAGS, PROMPT)
SINGLE = "tq_single_values"
# Fields of a prompt batch that say when or under which id it was drawn, not what it asks.
BOOKKEEPING = frozenset({"uid", "global_steps"})


def to_batch(data: Any, keys: Sequence[str], tags: Sequence[dict], prompts: Sequence[str | None]) -> Batch:
    """The trajectories ``data`` (rows in the order of ``keys``) as a ``Batch``; ``prompts``: the
    digest of the prompt behind each row (``None`` where it is not known)."""
    from tensordict import NonTensorData, NonTensorStack

    tensors, stacks, single = {}, {}, {}
    for name, value in data.items():
        if isinstance(value, NonTensorStack):
            stacks[name] = _items(value)
        elif isinstance(value, NonTensorData):
            single[name] = value.data
        else:
            tensors[name] = value
    return batch_of(tensors, stacks, single, keys, tags, prompts)


def batch_of(
    tensors: dict[str, Any],
    stacks: dict[str, list],
    single: dict[str, Any],
    keys: Sequence[str],
    tags: Sequence[dict],
    prompts: Sequence[str | None],
) -> Batch:
    """``to_batch`` of a TensorDict's fields already sorted by kind: tensors, ``NonTensorStack``
    values (a list, one per row) and ``NonTensorData`` values."""
    for name in (*tensors, *stacks, *single):
        if name in COLUMNS:
            raise ValueError(f"a TransferQueue field is named {name!r}, which skip uses for its own column")
    columns = {name: _objects(values) for name, values in stacks.items()}
    columns[KEY] = np.array(list(keys), dtype=object)
    columns[TAGS] = _objects([dict(tag) for tag in tags])
    columns[PROMPT] = _objects(list(prompts))
    return Batch(tensors, columns, {SINGLE: single})


def to_tensordict(batch: Batch, rows: Sequence[int]) -> Any:
    """Rows ``rows`` of a stored batch as the ``TensorDict`` TransferQueue takes."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    index = torch.as_tensor(list(rows), dtype=torch.int64)
    fields: dict[str, Any] = {}
    for name, tensor in batch.batch.items():
        if tensor.is_nested:  # jagged: no indexing along rows, so rows are taken one by one
            parts = tensor.unbind()
            # Into a buffer of its own: TransferQueue sends a jagged tensor's values from the
            # start of their storage, and a loaded entry's values share one mapped file.
            values = torch.cat([parts[i] for i in rows]).clone()
            lengths = torch.tensor([0] + [len(parts[i]) for i in rows], dtype=torch.int64)
            fields[name] = torch.nested.nested_tensor_from_jagged(values, lengths.cumsum(0))
        else:
            fields[name] = tensor.index_select(0, index).clone()
    for name, column in batch.non_tensor_batch.items():
        if name not in COLUMNS:
            fields[name] = NonTensorStack(*(column[i] for i in rows))
    single = batch.meta_info.get(SINGLE, {})
    if not isinstance(single, dict):
        raise ValueError(f"meta_info[{SINGLE!r}] is not a mapping")
    for name, value in single.items():
        fields[name] = NonTensorData(value)
    return TensorDict(fields, batch_size=[len(rows)])


def prompt_digests(batch: Any) -> list[str | None]:
    """One digest per prompt of a dataloader batch (a ``TensorDict``): what it asks, whatever
    uid it was drawn under. ``None`` for a prompt with a value that cannot be stored as data."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    rows = len(batch)
    digests = [xxhash.xxh3_128() for _ in range(rows)]
    known = [True] * rows
    for name in sorted(batch.keys()):
        if name in BOOKKEEPING:
            continue
        value = batch.get(name)
        if isinstance(value, NonTensorData):
            continue  # one value for the whole batch: bookkeeping such as ``validate``
        parts = value.unbind() if isinstance(value, torch.Tensor) and value.is_nested else value
        for i in range(rows):
            digests[i].update(name.encode() + b"\x00")
            if isinstance(value, NonTensorStack):
                try:
                    digests[i].update(json.dumps(encode(value[i].data, name), sort_keys=True).encode())
                except (ValueError, TypeError):
                    known[i] = False
            else:
                row = parts[i].detach().cpu().contiguous()
                digests[i].update(f"{row.dtype}|{tuple(row.shape)}|".encode())
                digests[i].update(row.reshape(-1).view(torch.uint8).numpy().tobytes())
    return [digest.hexdigest() if ok else None for digest, ok in zip(digests, known, strict=True)]


def _items(stack: Any) -> list:
    return [stack[i].data for i in range(len(stack))]


def _objects(values: list) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # one by one: a list value must stay one object
        array[i] = value
    return array
