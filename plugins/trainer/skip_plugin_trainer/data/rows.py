"""Rows of verl-shaped data files: parquet or JSON lines, each row named for error messages.

A row holds ``prompt`` chat messages, ``data_source``, ``reward_model.ground_truth`` and
``extra_info`` (``index``, ``tools_kwargs``), as verl's RLHFDataset reads them. Parquet adds
nulls where rows differ in shape; ``messages`` and ``tools_kwargs`` drop them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skip_core import reading
from skip_core.config import ConfigError
from skip_core.escaping import printable

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def data_files(files: Any, key: str) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [Path(os.path.expanduser(os.fspath(f))) for f in files]
    if not paths:
        raise ConfigError(f"{key}: no files given")
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"{key}: no such file {str(path)!r}")
        if path.suffix.lower() not in SUFFIXES:
            allowed = ", ".join(SUFFIXES)
            raise ConfigError(f"{key}: {str(path)!r} is not a data file; expected a suffix of {allowed} (JSON lines)")
    return paths


def read_rows(paths: list[Path]) -> list[tuple[str, Any]]:
    """Rows of every file in order, each with where it came from for error messages."""
    rows = []
    for path in paths:
        read = _read_parquet if SUFFIXES[path.suffix.lower()] == "parquet" else _read_jsonl
        rows.extend(read(path))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:  # empty, cut short, not parquet at all
        raise ConfigError(f"{printable(path)}: not a parquet file pyarrow can read ({printable(exc)})") from None
    return [(f"{path}, row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, encoding="utf-8", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:  # bounded in nesting and in what it costs to build, as every JSON skip reads
                rows.append((f"{path}, line {number}", reading.loads(line)))
            except ValueError as exc:
                why = printable(getattr(exc, "msg", exc))  # a JSONDecodeError's message without its position
                where = f"{printable(path)}, line {number}"
                raise ConfigError(f"{where}: not JSON ({why}); expected an object a line") from None
    return rows


def messages(row: Mapping[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """The chat messages of a row, without the null fields parquet adds for keys other messages have."""
    if row.get(key) is None:
        columns = ", ".join(map(str, row)) or "none"
        raise ConfigError(f"{where}: no prompt column {key!r} (data.prompt_key); columns: {columns}")
    messages = row[key]
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise ConfigError(f"{where}: {key!r} must be a list of chat messages ({{role, content}}), got {messages!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def tools_kwargs(value: Any) -> dict[str, dict[str, Any]]:
    """``extra_info.tools_kwargs`` without parquet's nulls.

    Parquet stores a mapping column as one struct for all rows, so a row reads back every tool
    and stage any row has, set to null where it had none. Those nulls are dropped: a null tool
    is not that row's tool, and a null stage has no arguments.
    """
    return {
        name: {stage: args for stage, args in (kwargs or {}).items() if args is not None}
        for name, kwargs in (value or {}).items()
        if kwargs is not None
    }
