"""Read span logs, ours or the article's, into one normalized pyarrow table.

Every analysis works on the same columns whatever wrote the logs: the recorder of this plugin
(``start``, ``pid``, span ids, ``extra`` request context) or the logger of the verl multi-turn
profiling article (an end ``timestamp`` and ``duration_sec``, ``workid`` or ``worker``, event
names such as ``engine_async_generate``, renamed through ``article.CANONICAL``). A process
killed mid-write leaves a truncated last line and a crashed writer can leave garbage: such
lines are skipped and counted, never fatal. So is a line whose numbers cannot be times: a
duration that is negative, NaN or not a number, a time or an id far past any a run writes
(``MAX_SECONDS``, ``MAX_ID``: the analyses add and multiply them in 64 bits). A bad field that
the line can do without (a ``start`` beside a ``timestamp``, a ``step`` its directory names) is
dropped instead. Lines that name an event and a time but no duration (the article's
``request_start``, ``turn_start``) are instants, not spans: they are counted apart and left out.

Each file is parsed by ``pyarrow.json`` (vectorized, a million lines in seconds); a file it
rejects (garbage lines, a field whose type changes between lines, bytes that are not UTF-8) is
parsed again line by line with ``skip_core.reading.loads``, and so is a file with a line that may nest deeper
than ``skip_core.reading.MAX_DEPTH`` (pyarrow recurses, and deep enough it kills the process).
A file that cannot be read is named and left out. Nothing is ever evaluated or unpickled.
"""

from __future__ import annotations

import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from skip_core import reading
from skip_core.reading import MAX_DEPTH, loads

from skip_plugin_profiling.article import ATTRIBUTES, CANONICAL
from skip_plugin_profiling.columns import array_of, as_string, cast, clean, coalesce, stack, with_default

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
_STEP_DIR = re.compile(r"^(val_)?step_(-?\d{1,9})$")
_WORKER_FILE = re.compile(r"worker_(-?\d{1,9})(?!\d)")
#: Times and durations, in seconds, past which a value is garbage: 1e11 s is the year 5138, and
#: a trace counts microseconds from the earliest span in 64 bits.
MAX_SECONDS = 1e11
#: Steps, workers, turns and ids past which a value is garbage: the analyses multiply two of
#: them into one 64-bit key.
MAX_ID = 2**31


@dataclass
class Logs:
    """The normalized events plus what reading them cost: files read, lines skipped."""

    table: pa.Table
    root: Path
    files: list[Path] = field(default_factory=list)
    skipped: dict[Path, int] = field(default_factory=dict)
    line_by_line: list[Path] = field(default_factory=list)
    instants: int = 0  # lines with an event and a time but no duration: markers, not spans
    unreadable: dict[Path, str] = field(default_factory=dict)  # files that could not be read, and why

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
        if self.instants:
            text += f"; left out {self.instants:,} instants (events without a duration)"
        if self.unreadable:
            where = ", ".join(f"{_relative(p, self.root)} ({why})" for p, why in sorted(self.unreadable.items()))
            text += f"; could not read {where}"
        return text


def _relative(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


class _Read(NamedTuple):
    """One file's normalized table and what could not become spans in it."""

    table: pa.Table
    skipped: int
    instants: int
    slow: bool  # parsed line by line
    error: str | None = None  # why the file could not be read


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
    logs = Logs(stack([r.table for r in results if r.table.num_rows], CORE), root, files)
    logs.instants = sum(r.instants for r in results)
    for file, result in zip(files, results, strict=True):
        logs.skipped[file] = result.skipped
        if result.slow:
            logs.line_by_line.append(file)
        if result.error is not None:
            logs.unreadable[file] = result.error
    return logs


def _find_files(root: Path) -> list[Path]:
    """Under a run directory only the step directories hold span logs (a metrics.jsonl next to
    them is something else); a step directory, or any other, is read whole."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"no such file or directory: {root}")
    steps = [d for d in root.iterdir() if d.is_dir() and _STEP_DIR.match(d.name)]
    # only regular files: a named pipe called worker_0.jsonl would block the read forever; and no
    # recursion, which a tree 1,100 directories deep would end in a RecursionError
    found = (here / name for d in steps or [root] for here, _, names in reading.walk(d) for name in names)
    return sorted(f for f in found if f.suffix == ".jsonl" and f.is_file())


def _context(file: Path) -> _Context:
    step, phase = None, "train"
    for parent in file.parents:
        match = _STEP_DIR.match(parent.name)
        if match:
            step, phase = int(match.group(2)), "val" if match.group(1) else "train"
            break
    worker = _WORKER_FILE.search(file.stem)
    return _Context(step, phase, int(worker.group(1)) if worker else None)


def _read_file(file: Path, index: int = 0) -> _Read:
    """Parse one file, fast path first."""
    empty = pa.table({f.name: pa.array([], f.type) for f in CORE})
    try:
        data = file.read_bytes()
    except OSError as exc:  # unreadable, or gone since it was listed
        return _Read(empty, 0, 0, False, exc.strerror or str(exc))
    data, skipped = _complete_lines(data)
    raw, slow = None, False
    if data and not data.isspace():
        raw = _read_fast(data)
        slow = raw is None
    if slow:
        raw, bad = _read_lines(data)
        skipped += bad
    if raw is None or raw.num_rows == 0:
        return _Read(empty, skipped, 0, slow)
    table, dropped, instants = _normalize(_flatten(raw), _context(file))
    table = table.set_column(CORE.get_field_index("file"), "file", pa.array(np.full(table.num_rows, index)))
    return _Read(table, skipped + dropped, instants, slow)


def _complete_lines(data: bytes) -> tuple[bytes, int]:
    """Drop an unterminated last line unless it is a whole JSON object (a writer killed
    mid-line leaves half an object; one that merely omitted the final newline does not)."""
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if not tail.strip():
        return data, 0
    try:
        whole = isinstance(loads(tail), dict)
    except ValueError:
        whole = False
    return (data + b"\n", 0) if whole else (data[:cut], 1)


def _read_fast(data: bytes) -> pa.Table | None:
    """The whole file parsed by pyarrow, or None where pyarrow refuses it or must not see it."""
    if _most_brackets(data) > MAX_DEPTH:
        return None
    try:
        table = pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(use_threads=False))
        # pyarrow 26 builds a list of nulls (``[null, null]``) one value short: an array that
        # crashes whatever reads it. The slow path builds such lists whole.
        table.validate(full=True)
    except (pa.ArrowException, ValueError):  # garbage, a type that changes, not UTF-8 (UnicodeDecodeError)
        return None
    return table


def _most_brackets(data: bytes) -> int:
    """The most opening brackets on one line, which bounds how deep it nests: a vectorized pass
    (a gigabyte a second) that keeps only the brackets and newlines."""
    codes = np.frombuffer(data, np.uint8)
    marks = codes[np.flatnonzero((codes == ord("[")) | (codes == ord("{")) | (codes == ord("\n")))]
    newline = marks == ord("\n")
    seen = np.cumsum(~newline)  # brackets up to each mark
    ends = np.r_[0, seen[newline], seen[-1] if len(seen) else 0]
    return int(np.diff(ends).max())


def _read_lines(data: bytes) -> tuple[pa.Table | None, int]:
    """The slow path: one parse per line (``skip_core.reading.loads``: nesting bounded), garbage
    counted, clashing types made strings."""
    rows, bad = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except ValueError:  # not JSON, not UTF-8, too deep, an integer of thousands of digits
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(_flat_dict(obj))
        else:
            bad += 1
    if not rows:
        return None, bad
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return pa.table({k: array_of([row.get(k) for row in rows]) for k in keys}), bad


def _flat_dict(obj: dict, prefix: str = "") -> dict[str, Any]:
    """Nested keys joined with dots, as pyarrow flattens structs; text made valid UTF-8."""
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            flat.update(_flat_dict(value, f"{prefix}{clean(key)}."))
        else:
            flat[f"{prefix}{clean(key)}"] = clean(value) if isinstance(value, str) else value
    return flat


def _flatten(table: pa.Table) -> pa.Table:
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    return table


def _normalize(raw: pa.Table, ctx: _Context) -> tuple[pa.Table, int, int]:
    """Map one file's flattened columns onto ``CORE`` plus attributes: (spans, unreadable rows,
    instants). Instants have an event and a time but no duration: not spans, yet not broken."""
    columns = _by_key(raw)
    n = raw.num_rows
    given = _pick(columns, "duration_sec")
    duration = _within(cast(given, pa.float64(), n), 0.0, MAX_SECONDS)
    # a duration written but unusable makes the line unreadable; one not written, an instant
    garbled = pc.and_(pc.is_valid(given), pc.is_null(duration)) if given is not None else None
    start = _within(cast(_pick(columns, "start"), pa.float64(), n), -MAX_SECONDS, MAX_SECONDS)
    end = pc.if_else(pc.is_null(start), _epoch(_pick(columns, "timestamp"), n), pc.add(start, duration))
    end = _within(end, -MAX_SECONDS, 2 * MAX_SECONDS)
    start = pc.coalesce(start, pc.subtract(end, duration))
    raw_event = cast(_pick(columns, "event"), pa.string(), n)
    out = {
        "step": with_default(_id(columns, "step", n), ctx.step if ctx.step is not None else 0),
        "phase": with_default(cast(_pick(columns, "phase"), pa.string(), n), ctx.phase),
        "workid": with_default(
            pc.coalesce(_id(columns, "workid", n), _id(columns, "worker", n)),
            ctx.workid if ctx.workid is not None else 0,
        ),
        "event": _canonical(raw_event),
        "raw_event": raw_event,
        "start": start,
        "end": end,
        "duration": duration,
    }
    out["request_id"] = cast(_pick(columns, "request_id"), pa.string(), n)
    for name in ("offset", "turn", "span_id", "parent_id", "pid"):
        out[name] = _id(columns, name, n)
    out["file"] = pa.chunked_array([pa.nulls(n, pa.int64())])
    for name, arrays in columns.items():
        if name not in _CONSUMED:
            out[name if name not in out else f"extra.{name}"] = coalesce(arrays)
    table = pa.table(out)
    timed = pc.and_(pc.is_valid(table["event"]), pc.is_valid(end))
    kept = table.filter(pc.and_(timed, pc.is_valid(duration)))
    instant = pc.and_(timed, pc.is_null(duration))
    if garbled is not None:
        instant = pc.and_(instant, pc.invert(garbled))
    instants = pc.sum(instant).as_py() or 0
    return kept, n - kept.num_rows - instants, instants


def _within(column: pa.ChunkedArray, low: float, high: float) -> pa.ChunkedArray:
    """``column`` with every value outside [low, high] made null, NaN included."""
    inside = pc.and_(pc.greater_equal(column, low), pc.less_equal(column, high))
    return pc.if_else(pc.fill_null(inside, False), column, pa.scalar(None, column.type))


def _id(columns: dict[str, list], key: str, n: int) -> pa.ChunkedArray:
    """An integer column (step, worker, turn, an id), null where it holds no integer below ``MAX_ID``."""
    return _within(cast(_pick(columns, key), pa.int64(), n), -MAX_ID + 1, MAX_ID - 1)


def _by_key(raw: pa.Table) -> dict[str, list[pa.ChunkedArray]]:
    """Group columns by attribute name: a top-level key and the same key in ``extra``."""
    columns: dict[str, list[pa.ChunkedArray]] = {}
    # by position: {"a.b": 1, "a": {"b": 2}} flattens to two columns named a.b
    for name, column in zip(raw.column_names, raw.columns, strict=True):
        key = name[len("extra.") :] if name.startswith("extra.") else name
        key = ATTRIBUTES.get(key, key)
        if key == "extra":  # an ``extra`` that was never an object with keys
            continue
        columns.setdefault(key, []).append(column)
    return columns


def _pick(columns: dict[str, list], key: str) -> pa.ChunkedArray | None:
    arrays = columns.get(key)
    return None if not arrays else coalesce(arrays)


def _canonical(raw_event: pa.ChunkedArray) -> pa.ChunkedArray:
    """Map names through ``article.CANONICAL`` once per distinct name, not per row."""
    encoded = raw_event.combine_chunks().dictionary_encode()
    names = [CANONICAL.get(v, v) for v in encoded.dictionary.to_pylist()]
    return pa.chunked_array([pc.take(pa.array(names, pa.string()), encoded.indices)])


def _epoch(timestamp: pa.ChunkedArray | None, n: int) -> pa.ChunkedArray:
    """ISO timestamps to Unix seconds. The article writes naive local time; it is read as UTC
    so all of one run's naive timestamps stay on one consistent clock."""
    if timestamp is None or pa.types.is_null(timestamp.type):
        return pa.chunked_array([pa.nulls(n, pa.float64())])
    parsed = timestamp if pa.types.is_timestamp(timestamp.type) else _parse_iso(as_string(timestamp))
    micros = parsed.cast(pa.timestamp("us", tz=parsed.type.tz)).cast(pa.int64())
    # past 2**53 microseconds (the year 2255) a double rounds them, and a safe cast would refuse
    return pc.divide(micros.cast(pa.float64(), safe=False), 1e6)


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
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    except (ValueError, OverflowError):  # not a time; a zone that moves it past year 9999
        return None
