"""``skip diff A B``: two training runs, or two skip caches, compared step by step and phase by phase.

A change of parallelism, backend, dtype or code should not move the numbers; this says whether it
did, and where first. For each step both sides have, the phases are compared in the order a step
computes them: the rollout tokens (exactly), then each per-token result (``rollout_log_probs``,
rewards, log-probs, values, advantages, returns) on the tokens both response masks mark, then the
scalar metrics of ``metrics.jsonl`` (losses, grad norms, the others; never timings, which differ
by nature). A value is beyond tolerance as ``numpy.isclose`` says: ``|a-b| > atol + rtol*|b|``.

A sample whose rollout tokens differ leaves the later per-token phases of its step: they would
compare results of different tokens. ``compare`` returns the ``Report``; the command prints it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from skip_core.config import StepSet

from skip_plugin_trainer.diff.sources import DiffError, memory_budget, open_source
from skip_plugin_trainer.train.train_data import KEYS

TOKENS = "rollout tokens"
#: The per-token results after the rollout, in the order a step computes them (``train_data.KEYS``).
PER_TOKEN = tuple(key for key in KEYS if key not in ("responses", "response_mask"))
PHASES = (TOKENS, *PER_TOKEN, "losses", "grad norms", "metrics")
#: Metrics of time and speed (any key with ``time`` in it, too), and the engines' batching counters
#: (how requests met in the engine depends on when each arrived): they differ from run to run by nature.
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/engine/")
#: Tokens compared at once: the float64 copies, masks and differences of a chunk stay near 50 MB,
#: whatever the size of a step's tensors.
CHUNK = 1 << 20


@dataclass(frozen=True)
class Difference:
    """One compared value of A and B at a step: of a token of a sample, or of a metric."""

    step: int
    a: float
    b: float
    diff: float
    sample: int | None = None
    token: int | None = None
    metric: str | None = None

    @property
    def place(self) -> str:
        return self.metric if self.metric is not None else f"sample {self.sample} token {self.token}"


@dataclass
class PhaseResult:
    """What one phase's comparison found over the steps. For rollout tokens (``exact``) a
    difference is a token that is not the same (or present on one side only), ``diff`` is 1 for
    it, and ``top`` holds the first differences rather than the largest."""

    name: str
    steps: list[int] = field(default_factory=list)
    compared: int = 0
    beyond: int = 0
    total: float = 0.0
    largest: Difference | None = None
    first: Difference | None = None
    top: list[Difference] = field(default_factory=list)
    #: Samples left out because their rollout tokens differ, summed over steps.
    left_out: int = 0
    #: (step, the shapes) where A and B could not be compared.
    shapes: list[tuple[int, str]] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.name == TOKENS

    @property
    def mean(self) -> float:
        return self.total / self.compared if self.compared else 0.0

    @property
    def first_step(self) -> int | None:
        """The first step beyond tolerance, shapes that differ included."""
        found = [self.first.step] if self.first else []
        return min(found + [step for step, _ in self.shapes[:1]], default=None)

    def add(
        self,
        step: int,
        x: np.ndarray,
        y: np.ndarray,
        diff: np.ndarray,
        beyond: np.ndarray,
        place: Callable[[int], dict],
        top: int,
    ) -> None:
        """A step's compared values (all of them, or one chunk of its rows): A's ``x``, B's ``y``,
        their ``diff`` and where it is ``beyond`` tolerance; ``place(i)`` says where the ``i``-th value is."""
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)
        self.compared += len(x)
        self.total += float(diff.sum())
        hits = np.flatnonzero(beyond)
        self.beyond += len(hits)

        def at(i: int) -> Difference:
            return Difference(step, x[i].item(), y[i].item(), float(diff[i]), **place(i))

        if len(hits) and self.first is None:
            self.first = at(hits[0])
        if len(diff) and (self.largest is None or diff.max() > self.largest.diff):
            self.largest = at(int(diff.argmax()))
        ranked = hits if self.exact else hits[np.argsort(-diff[hits], kind="stable")]
        self.top = self.top + [at(i) for i in ranked[:top]]
        if not self.exact:
            self.top.sort(key=lambda d: -d.diff)
        del self.top[top:]


@dataclass
class Report:
    """The comparison of A and B: per phase what was compared and found, and what could not be."""

    a: Path
    b: Path
    atol: float
    rtol: float
    steps: list[int]
    only_a: list[int]
    only_b: list[int]
    phases: list[PhaseResult] = field(default_factory=list)
    #: What was not compared (a phase or a metric on one side only, ...) -> the steps it concerns.
    notes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def first(self) -> PhaseResult | None:
        """The phase of the first difference: the earliest step, then the earliest phase."""
        differing = [p for p in self.phases if p.first_step is not None]
        return min(differing, key=lambda p: p.first_step, default=None)

    @property
    def agree(self) -> bool:
        return self.first is None

    @property
    def metrics_only(self) -> bool:
        """No step had per-token data on both sides: only the logged metrics were compared."""
        return not any(p.name == TOKENS or p.name in PER_TOKEN for p in self.phases)

    def headline(self) -> str:
        phase = self.first
        if phase is None:
            names = ", ".join(p.name for p in self.phases)
            within = f"atol={self.atol:g}, rtol={self.rtol:g}"
            steps = f"step{'s' * (len(self.steps) > 1)} {step_ranges(self.steps)}"  # 0..4: validation's step 0 too
            return f"A and B agree within {within} over {steps} (phases: {names})"
        d = phase.first
        if d is None or d.step != phase.first_step:
            step, shapes = phase.shapes[0]
            return f"first difference beyond tolerance: step {step}, {phase.name}: shapes differ ({shapes})"
        values = f"a={shown(d.a)}, b={shown(d.b)}" + ("" if phase.exact else f", |diff|={d.diff:.3g}")
        return f"first difference beyond tolerance: step {d.step}, {phase.name}, {d.place}: {values}"


def compare(
    a: Path,
    b: Path,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    steps: Container[int] | None = None,
    top: int = 5,
    ignore: Sequence[str] = (),
) -> Report:
    """Compare the runs or caches ``a`` and ``b`` over their common ``steps`` (all by default);
    ``top``: how many differences each phase keeps; ``ignore``: patterns (``fnmatch``) of metrics
    left out. ``DiffError`` naming the path for input that cannot be compared."""
    first, second = open_source(a), open_source(b)
    in_a = {s for s in first.steps() if steps is None or s in steps}
    in_b = {s for s in second.steps() if steps is None or s in steps}
    report = Report(first.path, second.path, atol, rtol, sorted(in_a & in_b), sorted(in_a - in_b), sorted(in_b - in_a))
    report.notes = {note: [] for note in first.notes + second.notes}
    comparison = _Comparison(report, top, ignore)
    budget = memory_budget()
    for step in report.steps:
        _check_budget(step, {**first.sizes(step), **second.sizes(step)}, budget)
        comparison.tensors(step, first.tensors(step), second.tensors(step))
        comparison.metrics(step, first.metrics.get(step, {}), second.metrics.get(step, {}))
    report.phases = [p for p in comparison.phases.values() if p.steps or p.shapes]
    if not report.phases:
        raise DiffError(
            f"nothing in common to compare: {first.path} has steps {step_ranges(in_a)}, "
            f"{second.path} has {step_ranges(in_b)}"
        )
    return report


def _check_budget(step: int, sizes: Mapping[Path, int], budget: int | None) -> None:
    """Refuse a step whose files (both sides' are loaded together) exceed ``budget`` bytes, before
    any is read: a file of kilobytes on disk may declare gigabytes (a sparse file reads as zeros)."""
    if budget is not None and sum(sizes.values()) > budget:
        biggest = max(sizes, key=sizes.__getitem__)
        raise DiffError(
            f"step {step}: A's and B's tensors take {sum(sizes.values()) / 2**30:.1f} GiB "
            f"({biggest}: {sizes[biggest] / 2**30:.1f} GiB), more than half the memory available "
            f"({budget / 2**30:.1f} GiB); compare on a machine with more memory"
        )


class _Comparison:
    """The phases of a ``Report`` filled step by step."""

    def __init__(self, report: Report, top: int, ignore: Sequence[str]) -> None:
        self.report, self.top, self.ignore = report, top, ignore
        self.phases = {name: PhaseResult(name) for name in PHASES}

    def note(self, text: str, step: int) -> None:
        self.report.notes.setdefault(text, []).append(step)

    def tensors(self, step: int, ta: Mapping[str, Any], tb: Mapping[str, Any]) -> None:
        """Compare a step's per-token phases, ``CHUNK`` tokens of rows at a time: a copy of a
        whole tensor as float64 (and its masks and differences) would cost many times its bytes."""
        for key, name in [("responses", TOKENS), *zip(PER_TOKEN, PER_TOKEN, strict=True)]:
            if (key in ta) != (key in tb):
                self.note(f"{name}: only in {'A' if key in ta else 'B'}", step)
        ma, mb = ((_padded(t["response_mask"]) != 0).numpy() if "response_mask" in t else None for t in (ta, tb))
        if ma is None and mb is None and ta.keys() & tb.keys() & {"responses", *PER_TOKEN}:
            self.note("no response_mask on either side: every token compared", step)
        ma, mb = (mb if ma is None else ma), (ma if mb is None else mb)  # one side's mask serves both
        compared = {}
        for key in ("responses", *PER_TOKEN):
            if key in ta and key in tb:
                problem = _misfit(_padded(ta[key]), _padded(tb[key]), ma, mb)
                if problem:
                    self.phases[TOKENS if key == "responses" else key].shapes.append((step, problem))
                else:
                    compared[key] = (_padded(ta[key]), _padded(tb[key]))
        if not compared:
            return
        rows, width = len(ma if ma is not None else next(iter(compared.values()))[0]), _width(compared)
        left_out = 0
        for start in range(0, rows, max(1, CHUNK // max(width, 1))):
            at = slice(start, start + max(1, CHUNK // max(width, 1)))
            va, vb = (_mask(m, at, width, compared) for m in (ma, mb))
            keep = None
            if "responses" in compared:
                a, b = compared["responses"]
                keep = self.rollout(step, _array(a[at])[:, :width], _array(b[at])[:, :width], va, vb, start)
                left_out += int((~keep).sum())
            for key in PER_TOKEN:
                if key in compared:
                    a, b = compared[key]
                    self.values(step, key, _array(a[at])[:, :width], _array(b[at])[:, :width], va, vb, keep, start)
        for key in PER_TOKEN:
            if key in compared and "responses" in compared:
                self.phases[key].left_out += left_out

    def rollout(self, step: int, a: np.ndarray, b: np.ndarray, va: Any, vb: Any, start: int) -> np.ndarray:
        """Compare the tokens either mask marks in rows ``start``...; the samples whose tokens all
        agree, to keep for later phases."""
        marked = va | vb
        rows, cols = np.nonzero(marked)
        x, y = a[marked], b[marked]
        beyond = (va[marked] != vb[marked]) | (x != y)
        self.phases[TOKENS].add(step, x, y, beyond.astype(np.float64), beyond, _token(rows + start, cols), self.top)
        keep = np.ones(len(a), dtype=bool)
        keep[rows[beyond]] = False
        return keep

    def values(
        self, step: int, key: str, a: np.ndarray, b: np.ndarray, va: Any, vb: Any, keep: Any, start: int
    ) -> None:
        both = va & vb
        if keep is not None:
            both &= keep[:, None]
        rows, cols = np.nonzero(both)
        x, y = a[both], b[both]
        self.phases[key].add(step, x, y, *self.close(x, y), _token(rows + start, cols), self.top)

    def metrics(self, step: int, ma: Mapping[str, float], mb: Mapping[str, float]) -> None:
        keys = {key for key in ma.keys() | mb.keys() if not key.startswith(TIMING) and "time" not in key}
        keys = {key for key in keys if not any(fnmatch.fnmatchcase(key, pattern) for pattern in self.ignore)}
        for key in sorted(keys - (ma.keys() & mb.keys())):
            self.note(f"metric {key}: only in {'A' if key in ma else 'B'}", step)
        groups: dict[str, list[str]] = {}
        for key in sorted(keys & ma.keys() & mb.keys()):
            group = "losses" if "loss" in key else "grad norms" if "grad_norm" in key else "metrics"
            groups.setdefault(group, []).append(key)
        for group, names in groups.items():
            x, y = np.array([ma[k] for k in names]), np.array([mb[k] for k in names])
            self.phases[group].add(step, x, y, *self.close(x, y), _metric(names), self.top)

    def close(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """|x-y| (NaN against a number, or opposite infinities, as infinite) and where it is beyond tolerance."""
        x, y = x.astype(np.float64), y.astype(np.float64)  # unsigned integers would wrap around in x - y
        close = np.isclose(x, y, rtol=self.report.rtol, atol=self.report.atol, equal_nan=True)
        with np.errstate(invalid="ignore"):
            diff = np.abs(x - y)
        return np.where(np.isnan(diff), np.where(close, 0.0, np.inf), diff), ~close


def _padded(tensor: Any) -> Any:
    """A jagged tensor (one row per sample) padded with zeros, which no mask marks; others as they are."""
    return tensor.to_padded_tensor(0) if tensor.is_nested else tensor


def _array(tensor: Any) -> np.ndarray:
    """A tensor as numpy: floats (bf16 too, which numpy lacks) as float64, so every dtype compares alike."""
    return tensor.double().numpy() if tensor.is_floating_point() else tensor.numpy()


def _misfit(a: Any, b: Any, ma: Any, mb: Any) -> str | None:
    """Why ``a`` and ``b`` (and the masks) cannot be compared token by token, from their shapes
    and from a mask marking a token past the common width; ``None`` when they can."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    fa, fb = sa if ma is None else ma.shape, sb if mb is None else mb.shape
    fits = len(sa) == len(sb) == 2 and sa[0] == sb[0] and (fa, fb) == (sa, sb)
    width = min(sa[-1], sb[-1]) if fits else 0
    if fits and not any(m is not None and m[:, width:].any() for m in (ma, mb)):
        return None
    masks = "" if (fa, fb) == (sa, sb) else f"; masks A {list(fa)}, B {list(fb)}"
    return f"A {list(sa)}, B {list(sb)}{masks}"


def _width(compared: Mapping[str, tuple[Any, Any]]) -> int:
    """The response width every compared tensor has on both sides (masks mark nothing past it)."""
    return min(min(a.shape[-1], b.shape[-1]) for a, b in compared.values())


def _mask(mask: np.ndarray | None, at: slice, width: int, compared: Mapping[str, tuple[Any, Any]]) -> np.ndarray:
    """The rows ``at`` of a side's mask, cut to ``width``; every token, without one."""
    if mask is not None:
        return mask[at, :width]
    rows = len(next(iter(compared.values()))[0][at])
    return np.ones((rows, width), dtype=bool)


def _token(rows: np.ndarray, cols: np.ndarray) -> Callable[[int], dict]:
    return lambda i: {"sample": int(rows[i]), "token": int(cols[i])}


def _metric(names: list[str]) -> Callable[[int], dict]:
    return lambda i: {"metric": names[i]}


def shown(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def step_ranges(steps: Any) -> str:
    return str(StepSet((s, s) for s in steps)) or "none"
