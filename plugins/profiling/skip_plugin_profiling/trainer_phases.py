"""Where the trainer's step went, phase by phase, from the driver's ``trainer/<phase>`` spans.

Phases nest: ``trainer/step`` holds them all and ``trainer/testing`` holds
``trainer/validate``. Adding nested spans up counts their time twice (a step whose bar is
taller than the step), so each phase is credited only with its exclusive time, the part not
inside another phase, and these add up to the step's wall time exactly.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from skip_plugin_profiling.intervals import union_length
from skip_plugin_profiling.results import TrainerPhases

PREFIX = "trainer/"
STEP = "trainer/step"
#: Slack when judging by time whether one span lies inside another (clock rounding), seconds.
_SLACK = 1e-6


def trainer_phases(table: pa.Table) -> TrainerPhases | None:
    """Exclusive seconds per trainer phase per step; None when no phase was logged."""
    mask = pc.and_(pc.equal(table["workid"], -1), pc.starts_with(table["event"], PREFIX))
    rows = table.filter(pc.fill_null(mask, False)).sort_by([("start", "ascending")])
    if rows.num_rows == 0:
        return None
    spans = rows.select(["step", "event", "start", "end"]).to_pylist()
    parents = _parents(rows, spans)
    own = _exclusive(spans, parents)
    nested: dict[str, set[str]] = defaultdict(set)
    for i, p in enumerate(parents):
        if p is not None and spans[p]["event"] != STEP:
            nested[_name(spans[p]["event"])].add(_name(spans[i]["event"]))
    return _table(spans, own, {k: sorted(v) for k, v in nested.items()})


def _parents(rows: pa.Table, spans: list[dict]) -> list[int | None]:
    """The phase span holding each span: by parent id where the writer gave span ids, else
    the shortest phase span of the same step that contains it in time."""
    pid, span_id, parent_id = (
        rows[c].to_pylist() if c in rows.column_names else [None] * rows.num_rows
        for c in ("pid", "span_id", "parent_id")
    )
    by_id = {(p, s): i for i, (p, s) in enumerate(zip(pid, span_id, strict=True)) if p is not None and s}
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, span in enumerate(spans):
        by_step[span["step"]].append(i)
    parents: list[int | None] = []
    for i, span in enumerate(spans):
        if (pid[i], span_id[i]) in by_id:
            parents.append(by_id.get((pid[i], parent_id[i])))
        else:
            parents.append(_container(i, spans, by_step[span["step"]]))
    return parents


def _container(i: int, spans: list[dict], candidates: list[int]) -> int | None:
    me, best, best_length = spans[i], None, float("inf")
    length = me["end"] - me["start"]
    for j in candidates:
        other = spans[j]
        outer = other["end"] - other["start"]
        inside = other["start"] - _SLACK <= me["start"] and me["end"] <= other["end"] + _SLACK
        if j != i and inside and length <= outer < best_length:
            best, best_length = j, outer
    return best


def _exclusive(spans: list[dict], parents: list[int | None]) -> list[float]:
    """Each span's duration less the union of its children's."""
    children: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(parents):
        if p is not None:
            children[p].append(i)
    own = []
    for i, span in enumerate(spans):
        kids = children.get(i, [])
        inner = np.array([[spans[k]["start"], spans[k]["end"]] for k in kids]).reshape(-1, 2)
        covered = float(union_length(np.zeros(len(kids), int), inner[:, 0], inner[:, 1], 1)[0])
        own.append(max(span["end"] - span["start"] - covered, 0.0))
    return own


def _name(event: str) -> str:
    return event.removeprefix(PREFIX)


def _table(spans: list[dict], own: list[float], nested: dict[str, list[str]]) -> TrainerPhases:
    """step, total, the phases in the order they run, other (the step span's own time)."""
    steps = sorted({s["step"] for s in spans})
    phases = _order(spans)
    cells: dict[tuple[int, str], float] = defaultdict(float)
    first, last, whole = {}, {}, defaultdict(float)
    for span, seconds in zip(spans, own, strict=True):
        step = span["step"]
        cells[(step, span["event"])] += seconds
        first[step] = min(first.get(step, span["start"]), span["start"])
        last[step] = max(last.get(step, span["end"]), span["end"])
        if span["event"] == STEP:
            whole[step] += span["end"] - span["start"]
    columns: dict[str, list] = {"total": [whole[s] or last[s] - first[s] for s in steps]}
    for event in phases:
        columns[_column(event, nested)] = [cells.get((s, event), 0.0) for s in steps]
    inside = [sum(cells.get((s, e), 0.0) for e in phases) for s in steps]
    columns["other"] = [max(t - i, 0.0) for t, i in zip(columns["total"], inside, strict=True)]
    table = pa.table({"step": pa.array(steps, pa.int64()), **columns})
    return TrainerPhases(table, [_name(e) for e in phases], nested)


def _order(spans: list[dict]) -> list[str]:
    """Phases in the order they ran in the step that ran the most of them (a validation
    before training is a step of its own and must not put ``validate`` first), then the rest."""
    by_step: dict[int, list[str]] = defaultdict(list)
    for span in spans:  # sorted by start
        if span["event"] != STEP:
            by_step[span["step"]].append(span["event"])
    fullest = max(by_step.values(), key=lambda names: len(set(names)), default=[])
    return list(dict.fromkeys([*fullest, *(s["event"] for s in spans if s["event"] != STEP)]))


def _column(event: str, nested: dict[str, list[str]]) -> str:
    """A phase that holds others is credited only with its time outside them; say so."""
    name = _name(event)
    return f"{name} (excl. {', '.join(nested[name])})" if name in nested else name
