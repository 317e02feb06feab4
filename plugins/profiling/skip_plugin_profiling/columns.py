"""Lenient pyarrow columns: casts that turn what a type cannot hold into nulls instead of
failing a file, and the stacking of per-file tables whose attribute columns differ.

Logs come from many writers and versions: ``tool`` is a number in one file and a string in
the next, a step may be written as a float. One odd value must cost that value, not the file.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def cast(column: pa.ChunkedArray | None, type_: pa.DataType, n: int) -> pa.ChunkedArray:
    """Cast leniently: a value the type cannot hold becomes null rather than failing the file."""
    if column is None:
        return pa.chunked_array([pa.nulls(n, type_)])
    if column.type == type_:
        return column
    if pa.types.is_null(column.type):
        return pa.chunked_array([pa.nulls(n, type_)])
    if type_ == pa.string():
        return as_string(column)
    try:
        return column.cast(type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = [_number(v, type_) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, type_)])


def _number(value: Any, type_: pa.DataType) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not np.isfinite(number):
        return None
    return int(number) if pa.types.is_integer(type_) else number


def as_string(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_string(column.type):
        return column
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, pa.string())])


def coalesce(arrays: list[pa.ChunkedArray]) -> pa.ChunkedArray:
    """The first non-null of several columns of one key (a top-level key and ``extra.key``)."""
    if len(arrays) == 1:
        return arrays[0]
    try:
        return pc.coalesce(*arrays)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pc.coalesce(*[as_string(a) for a in arrays])


def with_default(column: pa.ChunkedArray, default: Any) -> pa.ChunkedArray:
    return pc.fill_null(column, pa.scalar(default, column.type))


def array_of(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def stack(tables: list[pa.Table], core: pa.Schema) -> pa.Table:
    """Stack per-file tables of the ``core`` columns plus attribute columns that may differ in
    presence and type between files (a number in one, a string in another)."""
    if not tables:
        return pa.table({f.name: pa.array([], f.type) for f in core})
    types: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for f in table.schema:
            if f.name not in core.names:
                types.setdefault(f.name, set()).add(f.type)
    schema = pa.schema(list(core) + [(name, _unify(found)) for name, found in types.items()])
    return pa.concat_tables([_conform(t, schema) for t in tables]).combine_chunks()


def _unify(found: set[pa.DataType]) -> pa.DataType:
    found = {t for t in found if not pa.types.is_null(t)}
    if not found:
        return pa.null()
    if len(found) == 1:
        return found.pop()
    if all(pa.types.is_integer(t) or pa.types.is_boolean(t) for t in found):
        return pa.int64()
    if all(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) for t in found):
        return pa.float64()
    return pa.string()


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    n = table.num_rows
    columns = []
    for f in schema:
        if f.name not in table.column_names:
            columns.append(pa.chunked_array([pa.nulls(n, f.type)]))
        elif table[f.name].type == f.type:
            columns.append(table[f.name])
        elif f.type == pa.string():
            columns.append(as_string(table[f.name]))
        else:
            columns.append(table[f.name].cast(f.type))
    return pa.Table.from_arrays(columns, schema=schema)
