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
    """Cast leniently: a value the type cannot hold becomes null rather than failing the file.
    ``true`` is not a number here, and neither are NaN, the infinities or an integer past 64 bits."""
    if column is None:
        return pa.chunked_array([pa.nulls(n, type_)])
    if column.type == type_:
        return column
    if pa.types.is_null(column.type) or (pa.types.is_boolean(column.type) and _numeric(type_)):
        return pa.chunked_array([pa.nulls(n, type_)])
    if type_ == pa.string():
        return as_string(column)
    try:
        return column.cast(type_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = [_number(v, type_) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, type_)])


def _numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_)


def _number(value: Any, type_: pa.DataType) -> Any:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not np.isfinite(number):
        return None
    if not pa.types.is_integer(type_):
        return number
    return int(number) if -_INT64 <= number < _INT64 else None


_INT64 = 2.0**63


def as_string(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_string(column.type):
        return column
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.chunked_array([pa.array([_text(v) for v in column.to_pylist()], pa.string())])


def _text(value: Any) -> str | None:
    """A value as text: strings as they are (lone surrogates, which UTF-8 cannot hold, replaced),
    anything else as JSON (whose escapes are ASCII)."""
    if value is None:
        return None
    if isinstance(value, str):
        return clean(value)
    return json.dumps(value, default=str)


def clean(text: str) -> str:
    """``text`` with lone surrogates (``"\\ud800"`` in JSON) replaced: pyarrow takes only UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


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
    """One column of the slow path's rows: its own type when the values share one, else text.
    ``true`` beside numbers is not 1: pyarrow would make it one."""
    kinds = {type(v) for v in values if v is not None}
    if bool in kinds and len(kinds) > 1:
        return pa.array([_text(v) for v in values], pa.string())
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, ValueError, TypeError):  # mixed types, huge ints, surrogates
        return pa.array([_text(v) for v in values], pa.string())


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
