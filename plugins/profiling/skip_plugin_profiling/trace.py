"""Chrome trace-event JSON of the spans, for Perfetto (ui.perfetto.dev) and chrome://tracing.

One process track per worker (``pid`` = workid + 1, so the trainer driver, workid -1, is pid 0)
and, inside it, lanes (``tid``) laid out so a viewer can draw them: trace viewers nest "X"
events on one thread by time and mangle partial overlaps, while a rollout worker runs hundreds
of requests at once. So each request gets a lane of its own for its whole life (first free
lane by time interval), its turn, generate and tool spans nest inside it there, and
worker-level spans (rollout, padding, barrier waits) go on lane 0. A span that would still
partly overlap another on its lane (say two tool calls of one turn in parallel) moves to an
overflow lane. Times are integer microseconds from the earliest span.

The JSON text of the events is built column-wise with pyarrow and written in chunks, so a
million spans take seconds and little memory beyond the table.
"""

from __future__ import annotations

import heapq
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from skip_core import writing

from skip_plugin_profiling.logs import Logs

_CHUNK = 100_000
#: Rounding slack when nesting spans on one lane, in microseconds.
_SLACK_US = 100
_NOT_ARGS = {"workid", "event", "raw_event", "start", "end", "duration", "span_id", "parent_id", "phase", "file"}


def write_trace(
    logs: Logs | pa.Table,
    path: str | os.PathLike,
    steps: list[int] | None = None,
    root: str | os.PathLike | None = None,
) -> Path:
    """Write the spans (of ``steps``, all by default) as a Chrome trace; returns the path.
    ``root``: the directory above ``path`` below which no link is followed (``skip_core.writing``);
    by default the file's own directory."""
    table = logs.table if isinstance(logs, Logs) else logs
    if steps:
        table = table.filter(pc.is_in(table["step"], pa.array(list(steps), pa.int64())))
    path = Path(path)
    root = path.parent if root is None else Path(root)
    with writing.opened(root, path.relative_to(root), "w") as out:
        out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        if table.num_rows:
            _write_events(table, out)
        out.write("]}\n")
    return path


def _write_events(table: pa.Table, out) -> None:
    start = pc.fill_null(table["start"], 0.0).to_numpy()
    end = np.maximum(pc.fill_null(table["end"], 0.0).to_numpy(), start)
    origin = start.min()
    ts = np.round((start - origin) * 1e6).astype(np.int64)
    te = np.round((end - origin) * 1e6).astype(np.int64)
    workid = pc.fill_null(table["workid"], -1).to_numpy()
    tid, lanes = _lanes(table, workid, ts, te)  # may clip ts/te by the slack
    metadata = _metadata(workid, lanes)
    out.write(",\n".join(metadata))
    lines = _event_lines(table, ts, te - ts, workid + 1, tid)
    for offset in range(0, len(lines), _CHUNK):
        chunk = lines.slice(offset, _CHUNK).to_pylist()
        out.write(",\n" + ",\n".join(chunk))
    out.write("\n")


def _lanes(table: pa.Table, workid: np.ndarray, ts: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, dict]:
    """(tid per span, {workid: {tid: kind}}): requests on lanes 1.., worker spans on 0, misfits after."""
    request = _request_index(table)
    lane_of_request, lanes = _request_lanes(request, workid, ts, te)
    wanted = lane_of_request[request] if len(lane_of_request) else np.zeros(len(request), np.int64)
    wanted[request < 0] = 0
    return _nest(workid, ts, te, wanted, lanes)


def _request_index(table: pa.Table) -> np.ndarray:
    ids = pc.fill_null(table["request_id"].combine_chunks().dictionary_encode().indices, -1).to_numpy()
    ids = ids.astype(np.int64)
    step = pc.fill_null(table["step"], 0).to_numpy()
    phases = table["phase"].combine_chunks().dictionary_encode()
    phase = pc.fill_null(phases.indices, 0).to_numpy().astype(np.int64)
    n_ids, n_phases = int(ids.max()) + 1, max(len(phases.dictionary), 1)
    key = np.where(ids >= 0, ((step - step.min()) * n_phases + phase) * n_ids + ids, -1)
    index = np.full(len(key), -1, np.int64)
    has = key >= 0
    index[has] = np.unique(key[has], return_inverse=True)[1]
    return index


def _request_lanes(request: np.ndarray, workid: np.ndarray, ts: np.ndarray, te: np.ndarray) -> tuple[np.ndarray, dict]:
    """Greedy interval partitioning per worker: each request takes the lowest free lane."""
    has = request >= 0
    n = int(request.max(initial=-1)) + 1
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.full(n, np.iinfo(np.int64).min)
    owner = np.zeros(n, np.int64)
    np.minimum.at(first, request[has], ts[has])
    np.maximum.at(last, request[has], te[has])
    owner[request[has]] = workid[has]
    lane = np.zeros(n, np.int64)
    lanes: dict[int, dict[int, str]] = {int(w): {0: "worker"} for w in np.unique(workid)}
    for w in np.unique(owner).tolist():
        mine = np.flatnonzero(owner == w)
        mine = mine[np.lexsort((last[mine], first[mine]))]
        lane[mine] = _partition(first[mine].tolist(), last[mine].tolist())
        lanes[w].update({int(k): "requests" for k in np.unique(lane[mine])})
    return lane, lanes


def _partition(starts: list[int], ends: list[int]) -> list[int]:
    free: list[tuple[int, int]] = []  # (end of its last request, lane)
    spare: list[int] = []  # lanes free for good, lowest first
    used = 0
    out = []
    for s, e in zip(starts, ends, strict=True):
        while free and free[0][0] <= s:
            heapq.heappush(spare, heapq.heappop(free)[1])
        if spare:
            lane = heapq.heappop(spare)
        else:
            used += 1
            lane = used
        heapq.heappush(free, (e, lane))
        out.append(lane)
    return out


def _nest(workid, ts, te, wanted, lanes) -> tuple[np.ndarray, dict]:
    """Keep each span on its wanted lane while it nests there; else move it to an overflow lane.

    Spans are visited per worker by start (bucketed by ``_SLACK_US``, longest first within a
    bucket, so a container logged a hair after its first child still comes first). Logged times
    are rounded: a span that overhangs its container or a sibling by at most ``_SLACK_US`` is
    clipped into place (``ts``/``te`` are updated) rather than sent to another lane.
    """
    order = np.lexsort((-te, ts // _SLACK_US, workid))
    tid = wanted.copy()
    stacks: dict[tuple[int, int], list[list[int]]] = {}
    overflow: dict[int, list[int]] = {}
    for i, w, lane in zip(order.tolist(), workid[order].tolist(), wanted[order].tolist(), strict=True):
        stack = stacks.get((w, lane))
        if stack is None:
            stack = stacks[(w, lane)] = []
        if not _place(stack, i, ts, te):
            tid[i] = _overflow_lane(w, i, ts, te, stacks, overflow, lanes)
    return tid, lanes


def _place(stack: list[list[int]], i: int, ts: np.ndarray, te: np.ndarray) -> bool:
    """Push span ``i`` on a lane's stack of open spans [start, end] if it nests; clip it by the slack."""
    s, e = int(ts[i]), int(te[i])
    floor = s
    while stack:
        top_end = stack[-1][1]
        if top_end <= s:
            stack.pop()
        elif e <= top_end + _SLACK_US:
            break  # inside the top span: nest under it
        elif top_end <= s + _SLACK_US:
            floor = max(floor, stack.pop()[1])  # a sibling overlapping by a rounding error
        else:
            return False
    if stack:
        outer_start, outer_end = stack[-1]
        floor, e = max(floor, outer_start), min(e, outer_end)
    s = min(floor, e)
    e = max(e, s)
    ts[i], te[i] = s, e
    stack.append([s, e])
    return True


def _overflow_lane(w: int, i: int, ts: np.ndarray, te: np.ndarray, stacks: dict, overflow: dict, lanes: dict) -> int:
    for lane in overflow.setdefault(w, []):
        if _place(stacks[(w, lane)], i, ts, te):
            return lane
    lane = max(lanes[w]) + 1
    lanes[w][lane] = "overflow"
    overflow[w].append(lane)
    stacks[(w, lane)] = [[int(ts[i]), int(te[i])]]
    return lane


def _metadata(workid: np.ndarray, lanes: dict[int, dict[int, str]]) -> list[str]:
    rows = []
    for w in sorted(lanes):
        pid = w + 1
        name = "trainer" if w == -1 else f"rollout worker {w}" if w >= 0 else f"worker {w}"
        rows.append(_meta("process_name", pid, 0, {"name": name}))
        rows.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        for lane, kind in sorted(lanes[w].items()):
            label = ("driver" if w < 0 else "worker") if kind == "worker" else f"{kind} {lane}"
            rows.append(_meta("thread_name", pid, lane, {"name": label}))
            rows.append(_meta("thread_sort_index", pid, lane, {"sort_index": lane}))
    return rows


def _meta(name: str, pid: int, tid: int, args: dict) -> str:
    return json.dumps({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}, separators=(",", ":"))


def _event_lines(table: pa.Table, ts: np.ndarray, dur: np.ndarray, pid: np.ndarray, tid: np.ndarray) -> pa.Array:
    """One JSON object per span, built column-wise."""
    parts = [
        '{"name":',
        _json_strings(table["event"]),
        ',"cat":',
        _json_strings(table["phase"]),
        ',"ph":"X","ts":',
        pa.array(ts).cast(pa.string()),
        ',"dur":',
        pa.array(dur).cast(pa.string()),
        ',"pid":',
        pa.array(pid).cast(pa.string()),
        ',"tid":',
        pa.array(tid).cast(pa.string()),
        ',"args":{',
        _args(table),
        "}}",
    ]
    return pc.binary_join_element_wise(*parts, "", null_handling="replace", null_replacement="")


def _args(table: pa.Table) -> pa.Array:
    fragments = []
    for name in table.column_names:
        if name in _NOT_ARGS:
            continue
        value = _json_values(table[name])
        if value is not None:  # the OS pid would read as the trace's pid: rename it
            key = "os_pid" if name == "pid" else name
            fragments.append(pc.binary_join_element_wise(json.dumps(key) + ":", value, ""))
    if not fragments:
        return pa.array([""] * table.num_rows)
    return pc.binary_join_element_wise(*fragments, ",", null_handling="skip")


def _json_values(column: pa.ChunkedArray) -> pa.Array | None:
    """JSON text of each value (null stays null, so the key is left out)."""
    column = column.combine_chunks()
    kind = column.type
    if pa.types.is_null(kind):
        return None
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _json_strings(column)
    if pa.types.is_floating(kind):
        finite = pc.is_finite(column)
        return pc.if_else(finite, column.cast(pa.string()), pa.scalar(None, pa.string()))
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return column.cast(pa.string())
    return pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string())


def _json_strings(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Escape each distinct string once."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    encoded = column.cast(pa.string()).dictionary_encode()
    quoted = pa.array([json.dumps(v) for v in encoded.dictionary.to_pylist()], pa.string())
    return pc.take(quoted, encoded.indices)
