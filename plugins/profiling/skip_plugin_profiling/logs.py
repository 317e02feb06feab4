"""Read span logs, ours or the article's, into one normalized pyarrow table.

Every analysis works on the same columns whatever wrote the logs: the recorder of this plugin
(``start``, ``pid``, span ids, ``extra`` request context) or the logger of the verl multi-turn
profiling article (an end ``timestamp`` and ``duration_sec``, ``workid`` or ``worker``, event
names such as ``engine_async_generate``). A process killed mid-write leaves a truncated last
line and a crashed writer can leave garbage: such lines are skipped and counted, never fatal.

Each file is parsed by ``pyarrow.json`` (vectorized, a million lines in seconds); a file it
rejects (garbage lines, a field whose type changes between lines) is parsed again line by line
with ``json.loads``. Nothing is ever evaluated or unpickled.
"""

from __future__ import annotations

import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

#: The article's event names mapped onto ours; names not listed are kept as written.
CANONICAL = {
    "engine_async_generate": "generate",
    "preprocessing_duration": "preprocess",
    "barrier_wait_duration": "barrier_wait",
    "padding_duration": "padding",
    "batch_construction_duration": "batch_construction",
    "total_step_duration": "rollout",
    "reward_duration": "reward",
}

#: The normalized columns every table has, in order; attributes follow as extra columns.
CORE = pa.schema(
    [
        ("step", pa.int64()),
        ("phase", pa.string()),
        ("workid", pa.int64()),
        ("event", pa.string()),
        ("raw_event", pa.string()),
        ("start", pa.float64()),
        ("end", pa.float64()),
        ("duration", pa.float64()),
        ("request_id", pa.string()),
        ("offset", pa.int64()),
        ("turn", pa.int64()),
        ("span_id", pa.int64()),
        ("parent_id", pa.int64()),
        ("pid", pa.int64()),
        ("file", pa.int64()),  # index into Logs.files: span ids are unique only within one file
    ]
)

# Source keys that feed the core columns; every other key becomes an attribute column.
_CONSUMED = {
    "timestamp",
    "event",
    "duration_sec",
    "workid",
    "worker",
    "step",
    "phase",
    "start",
    "request_id",
    "offset",
    "turn",
    "span_id",
    "parent_id",
    "pid",
    "file",
}
_STEP_DIR = re.compile(r"^(val_)?step_(-?\d+)$")
_WORKER_FILE = re.compile(r"worker_(-?\d+)")


@dataclass
class Logs:
    """The normalized events plus what reading them cost: files read, lines skipped."""

    table: pa.Table
    root: Path
    files: list[Path] = field(default_factory=list)
    skipped: dict[Path, int] = field(default_factory=dict)
    line_by_line: list[Path] = field(default_factory=list)

    @property
    def lines_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return self.table.num_rows

    def steps(self, phase: str | None = "train") -> list[int]:
        """The steps present (of ``phase``; all phases with ``None``), ascending."""
        table = self.table if phase is None else self.table.filter(pc.equal(self.table["phase"], phase))
        return sorted(pc.unique(table["step"]).to_pylist())

    def phases(self) -> list[str]:
        return sorted(pc.unique(self.table["phase"]).drop_null().to_pylist())

    def summary(self) -> str:
        """One line for a terminal: how much was read and how much could not be."""
        text = f"{len(self):,} events from {len(self.files)} files"
        if self.lines_skipped:
            where = ", ".join(f"{p.name} ({n})" for p, n in sorted(self.skipped.items()) if n)
            text += f"; skipped {self.lines_skipped} unreadable lines: {where}"
        return text


@dataclass(frozen=True)
class _Context:
    """What a file's location says when its lines do not: step, phase and worker."""

    step: int | None
    phase: str
    workid: int | None


def read_logs(path: str | os.PathLike) -> Logs:
    """Read a log directory tree (``step_*``, ``val_step_*``) or one ``.jsonl`` file."""
    root = Path(path)
    files = _find_files(root)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        results = list(pool.map(_read_file, files, range(len(files))))
    tables = [table for table, _, _ in results if table.num_rows]
    logs = Logs(_concat(tables), root, files)
    for file, (_, skipped, slow) in zip(files, results, strict=True):
        logs.skipped[file] = skipped
        if slow:
            logs.line_by_line.append(file)
    return logs


def _find_files(root: Path) -> list[Path]:
    """Under a run directory only the step directories hold span logs (a metrics.jsonl next to
    them is something else); a step directory, or any other, is read whole."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"no such file or directory: {root}")
    steps = [d for d in root.iterdir() if d.is_dir() and _STEP_DIR.match(d.name)]
    return sorted(f for d in steps or [root] for f in d.rglob("*.jsonl"))


def _context(file: Path) -> _Context:
    step, phase = None, "train"
    for parent in file.parents:
        match = _STEP_DIR.match(parent.name)
        if match:
            step, phase = int(match.group(2)), "val" if match.group(1) else "train"
            break
    worker = _WORKER_FILE.search(file.stem)
    return _Context(step, phase, int(worker.group(1)) if worker else None)


def _read_file(file: Path, index: int = 0) -> tuple[pa.Table, int, bool]:
    """Parse one file: (normalized table, lines skipped, whether it needed the slow path)."""
    data = file.read_bytes()
    data, skipped = _complete_lines(data)
    slow = False
    try:
        blank = not data or data.isspace()
        raw = None if blank else pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(use_threads=False))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raw, slow = None, True
    if slow:
        raw, bad = _read_lines(data)
        skipped += bad
    if raw is None or raw.num_rows == 0:
        return pa.table({f.name: pa.array([], f.type) for f in CORE}), skipped, slow
    table, dropped = _normalize(_flatten(raw), _context(file))
    table = table.set_column(CORE.get_field_index("file"), "file", pa.array(np.full(table.num_rows, index)))
    return table, skipped + dropped, slow


def _complete_lines(data: bytes) -> tuple[bytes, int]:
    """Drop an unterminated last line unless it is a whole JSON object (a writer killed
    mid-line leaves half an object; one that merely omitted the final newline does not)."""
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if not tail.strip():
        return data, 0
    try:
        whole = isinstance(json.loads(tail), dict)
    except ValueError:
        whole = False
    return (data + b"\n", 0) if whole else (data[:cut], 1)


def _read_lines(data: bytes) -> tuple[pa.Table | None, int]:
    """The slow path: one ``json.loads`` per line, garbage counted, clashing types made strings."""
    rows, bad = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(_flat_dict(obj))
        else:
            bad += 1
    if not rows:
        return None, bad
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return pa.table({k: _array([row.get(k) for row in rows]) for k in keys}), bad


def _flat_dict(obj: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            flat.update(_flat_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _array(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def _flatten(table: pa.Table) -> pa.Table:
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    return table


def _normalize(raw: pa.Table, ctx: _Context) -> tuple[pa.Table, int]:
    """Map one file's flattened columns onto ``CORE`` plus attributes; drop non-span rows."""
    columns = _by_key(raw)
    n = raw.num_rows
    duration = _as(_pick(columns, "duration_sec"), pa.float64(), n)
    start = _as(_pick(columns, "start"), pa.float64(), n)
    end = pc.if_else(pc.is_null(start), _epoch(_pick(columns, "timestamp"), n), pc.add(start, duration))
    start = pc.coalesce(start, pc.subtract(end, duration))
    raw_event = _as(_pick(columns, "event"), pa.string(), n)
    out = {
        "step": _with_default(_as(_pick(columns, "step"), pa.int64(), n), ctx.step if ctx.step is not None else 0),
        "phase": _with_default(_as(_pick(columns, "phase"), pa.string(), n), ctx.phase),
        "workid": _with_default(
            pc.coalesce(_as(_pick(columns, "workid"), pa.int64(), n), _as(_pick(columns, "worker"), pa.int64(), n)),
            ctx.workid if ctx.workid is not None else 0,
        ),
        "event": _canonical(raw_event),
        "raw_event": raw_event,
        "start": start,
        "end": end,
        "duration": duration,
    }
    for name in ("request_id", "offset", "turn", "span_id", "parent_id", "pid"):
        out[name] = _as(_pick(columns, name), CORE.field(name).type, n)
    out["file"] = pa.chunked_array([pa.nulls(n, pa.int64())])
    for name, arrays in columns.items():
        if name not in _CONSUMED:
            out[name if name not in out else f"extra.{name}"] = _coalesce(arrays)
    table = pa.table(out)
    keep = pc.and_(pc.is_valid(table["event"]), pc.and_(pc.is_valid(duration), pc.is_valid(end)))
    keep = pc.fill_null(keep, False)
    kept = table.filter(keep)
    return kept, n - kept.num_rows


def _by_key(raw: pa.Table) -> dict[str, list[pa.ChunkedArray]]:
    """Group columns by attribute name: a top-level key and the same key in ``extra``."""
    columns: dict[str, list[pa.ChunkedArray]] = {}
    for name in raw.column_names:
        key = name[len("extra.") :] if name.startswith("extra.") else name
        if key == "extra":  # an ``extra`` that was never an object with keys
            continue
        columns.setdefault(key, []).append(raw[name])
    return columns


def _pick(columns: dict[str, list], key: str) -> pa.ChunkedArray | None:
    arrays = columns.get(key)
    return None if not arrays else _coalesce(arrays)


def _coalesce(arrays: list[pa.ChunkedArray]) -> pa.ChunkedArray:
    if len(arrays) == 1:
        return arrays[0]
    try:
        return pc.coalesce(*arrays)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pc.coalesce(*[_to_string(a) for a in arrays])


def _as(column: pa.ChunkedArray | None, type_: pa.DataType, n: int) -> pa.ChunkedArray:
    """Cast leniently: a value the type cannot hold becomes null rather than failing the file."""
    if column is None:
        return pa.chunked_array([pa.nulls(n, type_)])
    if column.type == type_:
        return column
    if pa.types.is_null(column.type):
        return pa.chunked_array([pa.nulls(n, type_)])
    if type_ == pa.string():
        return _to_string(column)
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


def _to_string(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_string(column.type):
        return column
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in column.to_pylist()]
        return pa.chunked_array([pa.array(values, pa.string())])


def _with_default(column: pa.ChunkedArray, default: Any) -> pa.ChunkedArray:
    return pc.fill_null(column, pa.scalar(default, column.type))


def _canonical(raw_event: pa.ChunkedArray) -> pa.ChunkedArray:
    """Map names through ``CANONICAL`` once per distinct name, not per row."""
    encoded = raw_event.combine_chunks().dictionary_encode()
    names = [CANONICAL.get(v, v) for v in encoded.dictionary.to_pylist()]
    return pa.chunked_array([pc.take(pa.array(names, pa.string()), encoded.indices)])


def _epoch(timestamp: pa.ChunkedArray | None, n: int) -> pa.ChunkedArray:
    """ISO timestamps to Unix seconds. The article writes naive local time; it is read as UTC
    so all of one run's naive timestamps stay on one consistent clock."""
    if timestamp is None or pa.types.is_null(timestamp.type):
        return pa.chunked_array([pa.nulls(n, pa.float64())])
    parsed = timestamp if pa.types.is_timestamp(timestamp.type) else _parse_iso(_to_string(timestamp))
    micros = parsed.cast(pa.timestamp("us", tz=parsed.type.tz)).cast(pa.int64())
    return pc.divide(micros.cast(pa.float64()), 1e6)


def _parse_iso(text: pa.ChunkedArray) -> pa.ChunkedArray:
    for type_ in (pa.timestamp("us"), pa.timestamp("us", tz="UTC")):
        try:
            return text.cast(type_)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    # Mixed naive and zoned, or odd formats: parse each distinct string once.
    encoded = text.combine_chunks().dictionary_encode()
    seconds = [_iso_seconds(v) for v in encoded.dictionary.to_pylist()]
    micros = pa.array([None if s is None else round(s * 1e6) for s in seconds], pa.int64())
    return pa.chunked_array([pc.take(micros, encoded.indices).cast(pa.timestamp("us", tz="UTC"))])


def _iso_seconds(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Stack per-file tables whose attribute columns may differ in presence and type."""
    if not tables:
        return pa.table({f.name: pa.array([], f.type) for f in CORE})
    types: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for f in table.schema:
            if f.name not in CORE.names:
                types.setdefault(f.name, set()).add(f.type)
    schema = pa.schema(list(CORE) + [(name, _unify(found)) for name, found in types.items()])
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
            columns.append(_to_string(table[f.name]))
        else:
            columns.append(table[f.name].cast(f.type))
    return pa.Table.from_arrays(columns, schema=schema)
