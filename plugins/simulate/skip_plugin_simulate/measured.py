"""The models of ``skip simulate --from-profile DIR``, fit to what a real run's profile measured.

The profile is what ``skip run ... profiling.enable=true`` writes and ``skip profile report``
reads. From it:
- requests: every trained prompt's samples as they ran (tokens per turn, tool time, tokens a
  tool added), drawn whole, so a hard prompt keeps all its answers long;
- engines: from the run's ``metrics.jsonl`` where the backend counted its work
  (``rollout/engine/*``), each step's forward seconds against its decode passes and their rows,
  ``forward_s = decode_s x passes + decode_s_per_row x rows`` (prefill passes fold into both);
  otherwise from the spans: each ``generate`` span (one turn on the engine) lasts ``tokens_out x
  (decode_s + decode_s_per_row x rows) + prefill_s_per_token x new prompt tokens``, with
  ``rows`` the mean number of turns decoding beside it on its worker. Least squares either way;
- training: each step's trainer phases against the tokens it trained, ``fixed_s + s_per_token x
  tokens`` by least squares over the steps;
- weight sync: the mean of the run's weight push (``WEIGHT_SYNC``, or its name in an older profile).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from skip_core.config import ConfigError
from skip_core.schedule import TRAIN_PHASES, WEIGHT_SYNC

from skip_plugin_simulate.workload import Shape

#: The weight push as profiles recorded before the contract named it ``WEIGHT_SYNC`` time it (sync's,
#: one_step_off's and fully_async's names; ``update_weights`` is also verl's own): such a profile
#: still measures the run's weight sync (tests/data/long_tail is one).
OLDER_WEIGHT_SYNC = ("update_weights", "sync_rollout_weights", "param_sync")


@dataclass(frozen=True)
class Measured:
    groups: list[list[Shape]]  # per trained prompt, its samples
    val_groups: list[list[Shape]]  # per validation prompt (of all validations), its samples
    validations: list[int]  # the steps after which the run validated
    decode_s: float
    decode_s_per_row: float
    prefill_s_per_token: float
    max_batch: int
    s_per_token: float
    fixed_s: float
    sync_s: float
    engine_fit: str  # what the engine's costs were fit to
    steps: int

    def overrides(self) -> dict:
        """The simulation keys this profile measured."""
        sizes = [len(group) for group in self.groups]
        keys: dict = {
            "data": {"train_batch_size": max(1, round(len(self.groups) / max(self.steps, 1)))},
            "rollout": {"n": max(set(sizes), key=sizes.count)},
            "engines": {
                "decode_s": self.decode_s,
                "decode_s_per_row": self.decode_s_per_row,
                "prefill_s_per_token": self.prefill_s_per_token,
                "max_batch": self.max_batch,
            },
            "training": {"s_per_token": self.s_per_token, "fixed_s": self.fixed_s},
            "weight_sync": {"fixed_s": self.sync_s, "s_per_billion_params": 0.0},
        }
        after = [step for step in self.validations if step > 0]
        if self.val_groups and after:
            keys["data"]["val_prompts"] = max(1, round(len(self.val_groups) / len(self.validations)))
            keys["rollout"]["val_n"] = max(len(group) for group in self.val_groups)
            keys["trainer"] = {"test_freq": min(after)}
        return keys


def read_profile(directory: str | Path, metrics: str | Path | None = None) -> Measured:
    """``metrics``: the run's metrics.jsonl, by default the one beside the profile directory."""
    from skip_plugin_profiling.logs import read_logs

    metrics = Path(metrics) if metrics else Path(directory).parent / "metrics.jsonl"

    everything = read_logs(directory).table
    table = everything.filter(pc.equal(everything["phase"], "train"))
    val = everything.filter(pc.equal(everything["phase"], "val"))
    requests, generates = _events(table, "request"), _events(table, "generate")
    if not len(requests) or not len(generates):
        raise ConfigError(
            f"--from-profile {directory}: no request and generate spans (profile a run with profiling.enable=true)"
        )
    groups = _groups(requests, generates, _events(table, "tool_call"))
    val_requests = _events(val, "request")
    val_groups = _groups(val_requests, _events(val, "generate"), _events(val, "tool_call"))
    validations = sorted(set(val_requests["step"].to_pylist()))
    decode, per_row, prefill, max_batch = _fit_engine(generates)
    engine_fit = f"{len(generates)} turns' spans"
    counted = _fit_counters(metrics) if metrics.is_file() else None
    if counted is not None:
        decode, per_row, steps_counted = counted
        prefill, engine_fit = 0.0, f"the engine's counters over {steps_counted} steps of {metrics}"
    s_per_token, fixed, steps = _fit_training(table, requests)
    pushes = (WEIGHT_SYNC, *OLDER_WEIGHT_SYNC)
    syncs = [d for name in pushes for d in _events(table, f"trainer/{name}")["duration"].to_pylist()]
    return Measured(
        groups,
        val_groups,
        validations,
        decode,
        per_row,
        prefill,
        max_batch,
        s_per_token,
        fixed,
        float(np.mean(syncs)) if syncs else 0.0,
        engine_fit,
        steps,
    )


def _events(table: pa.Table, name: str) -> pa.Table:
    return table.filter(pc.equal(table["event"], name))


def _groups(requests: pa.Table, generates: pa.Table, tools: pa.Table) -> list[list[Shape]]:
    """Each prompt's samples: a request span's ``prompt`` (its batch row) within its rollout call
    (``parent_id`` in its process); a profile without it makes each sample its own prompt."""
    turns: dict[str, list[tuple[int, int, int]]] = {}
    for rid, turn, tokens_in, tokens_out in zip(
        *(generates[c].to_pylist() for c in ("request_id", "turn", "tokens_in", "tokens_out")), strict=True
    ):
        turns.setdefault(rid, []).append((turn or 0, tokens_in or 0, tokens_out or 0))
    tool_s: dict[str, list[float]] = {}
    for rid, seconds in zip(tools["request_id"].to_pylist(), tools["duration"].to_pylist(), strict=True):
        tool_s.setdefault(rid, []).append(seconds)
    rows = requests.to_pylist()
    groups: dict[tuple, list[Shape]] = {}
    for i, row in enumerate(rows):
        spans = sorted(turns.get(row["request_id"], []))
        if not spans:
            continue
        added = [max(0, b[1] - a[1] - a[2]) for a, b in itertools.pairwise(spans)]
        shape = Shape(
            prompt_tokens=int(row.get("prompt_tokens") or spans[0][1]),
            turns=[max(1, out) for _, _, out in spans],
            tool_tokens=int(np.mean(added)) if added else 0,
            tool_s=float(np.mean(tool_s[row["request_id"]])) if row["request_id"] in tool_s else 0.0,
        )
        prompt = row.get("prompt")
        key = (row["step"], row["pid"], row["parent_id"], prompt) if prompt is not None else (i,)
        groups.setdefault(key, []).append(shape)
    return list(groups.values())


def _fit_engine(generates: pa.Table) -> tuple[float, float, float, int]:
    start, end = generates["start"].to_numpy(), generates["end"].to_numpy()
    worker = generates["workid"].to_numpy()
    rows = np.zeros(len(start))
    most = 1
    for w in np.unique(worker):
        mine = worker == w
        rows[mine], peak = _mean_concurrency(start[mine], end[mine])
        most = max(most, peak)
    out = np.maximum(generates["tokens_out"].fill_null(0).to_numpy(zero_copy_only=False), 1).astype(float)
    tokens_in = generates["tokens_in"].fill_null(0).to_numpy(zero_copy_only=False).astype(float)
    turn = generates["turn"].fill_null(1).to_numpy(zero_copy_only=False)
    new_in = np.where(turn <= 1, tokens_in, 0.0)  # later turns prefill only what a tool added: small
    design = np.column_stack([out, out * rows, new_in])
    coef, *_ = np.linalg.lstsq(design, end - start, rcond=None)
    decode, per_row, prefill = (float(max(c, 0.0)) for c in coef)
    if decode == 0.0:  # a fit with no intercept left: the mean per-token time at the mean batch
        decode = float(np.sum(end - start) / np.sum(out)) / max(1.0, float(np.mean(rows)))
    return decode, per_row, prefill, most


def _fit_counters(metrics: Path) -> tuple[float, float, int] | None:
    """Per step, forward seconds against decode passes and their rows; None without counters."""
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if row.get("step", 0) > 0 and row.get("rollout/engine/decode_passes"):
            rows.append(row)
    if len(rows) < 2:
        return None
    design = np.array([[r["rollout/engine/decode_passes"], r["rollout/engine/decode_rows"]] for r in rows])
    seconds = np.array([r["rollout/engine/forward_s"] for r in rows])
    (decode, per_row), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if decode <= 0 or per_row < 0:  # rows per pass too alike to separate: all of it per row
        decode, per_row = 0.0, float(seconds.sum() / design[:, 1].sum())
    return float(decode), float(per_row), len(rows)


def _mean_concurrency(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, int]:
    """Each span's mean number of spans running (itself included) over its own lifetime."""
    times = np.unique(np.concatenate([start, end]))
    change = np.zeros(len(times))
    np.add.at(change, np.searchsorted(times, start), 1)
    np.add.at(change, np.searchsorted(times, end), -1)
    running = np.cumsum(change)[:-1]  # spans running between times[i] and times[i + 1]
    area = np.concatenate([[0.0], np.cumsum(running * np.diff(times))])
    a, b = np.searchsorted(times, start), np.searchsorted(times, end)
    length = np.maximum(end - start, 1e-12)
    return (area[b] - area[a]) / length, int(running.max(initial=1))


def _fit_training(table: pa.Table, requests: pa.Table) -> tuple[float, float, int]:
    driver = table.filter(pc.equal(table["workid"], -1))
    seconds: dict[int, float] = {}
    for phase in TRAIN_PHASES:
        spans = _events(driver, f"trainer/{phase}")
        for step, duration in zip(spans["step"].to_pylist(), spans["duration"].to_pylist(), strict=True):
            seconds[step] = seconds.get(step, 0.0) + duration
    tokens: dict[int, float] = {}
    both = pc.add(requests["prompt_tokens"].fill_null(0), requests["response_tokens"].fill_null(0)).to_pylist()
    for step, count in zip(requests["step"].to_pylist(), both, strict=True):
        tokens[step] = tokens.get(step, 0.0) + count
    steps = sorted(set(seconds) & set(tokens))
    if not steps:
        return 0.0, 0.0, 0
    x, y = np.array([tokens[s] for s in steps]), np.array([seconds[s] for s in steps])
    if len(steps) > 2 and np.ptp(x) > 0:
        slope, intercept = np.polyfit(x, y, 1)
        if slope > 0 and intercept >= 0:
            return float(slope), float(intercept), len(steps)
    return float(y.sum() / x.sum()), 0.0, len(steps)
