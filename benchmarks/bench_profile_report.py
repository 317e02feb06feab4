"""Time ``skip profile`` on a million events: reading, the analyses, the report and the trace.

The logs are written by skip-plugin-profiling's own ``Recorder`` (one per simulated worker,
as each Ray actor has one) from spans nested as the agent loop nests them: per request a
``preprocess``, one to three turns of ``generate`` + ``tool_call``, a ``tool_reward``; per
worker ``rollout`` and ``padding``; per step the driver's ``barrier_wait`` per worker and
trainer phases. Generation times are drawn at random; worker 0 of the middle step is a
planted straggler (its requests take 4x longer), which the findings must name.

Run: ``python benchmarks/bench_profile_report.py --events 1000000``
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from skip_core.spans import Span
from skip_plugin_profiling import analysis
from skip_plugin_profiling.logs import read_logs
from skip_plugin_profiling.recorder import Recorder
from skip_plugin_profiling.report import write_report
from skip_plugin_profiling.trace import write_trace

EVENTS_PER_REQUEST = 9  # preprocess, request, tool_reward, and 2 turns x (turn, generate, tool_call) on average


def emit(recorder: Recorder, name: str, parent: Span | None, start: float, end: float, **attrs) -> Span:
    span = child(name, parent, **attrs)
    span.start, span.end = start, end
    recorder.end(span)
    return span


def child(name: str, parent: Span | None, **attrs) -> Span:
    """A span of ``parent`` made by hand: these spans are written, not run."""
    span = Span(name, **attrs)
    span.parent = parent
    return span


def write_logs(root: Path, events: int, steps: int, workers: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    per_worker = max(1, events // (steps * workers * EVENTS_PER_REQUEST))
    recorders = {w: Recorder(root, worker=w, flush_interval_s=3600) for w in range(-1, workers)}
    clock, straggler_step = 1.7e9, steps // 2 + 1
    for step in range(1, steps + 1):
        ends = {}
        for w in range(workers):
            slow = 4.0 if (step, w) == (straggler_step, 0) else 1.0
            ends[w] = rollout(recorders[w], rng, step, w, clock, per_worker, slow)
        last = max(ends.values())
        driver = recorders[-1]
        top = emit(driver, "trainer/step", None, clock - 0.5, last + 15.0, step=step)
        gen = emit(driver, "trainer/gen", top, clock - 0.1, last + 0.2)
        for w, end in ends.items():
            emit(driver, "barrier_wait", gen, end, last, workid=w)
        emit(driver, "batch_construction", gen, last, last + 0.2, workers=workers)
        emit(driver, "trainer/update_actor", top, last + 1.0, last + 14.0)
        clock = last + 20.0
    for recorder in recorders.values():
        recorder.close()
    return sum(r.written for r in recorders.values())


def rollout(recorder: Recorder, rng: random.Random, step: int, w: int, t0: float, requests: int, slow: float) -> float:
    worker = child("rollout", None, step=step, phase="train", requests=requests)
    worker.start, end = t0, t0
    for r in range(requests):
        rid = f"{step}-{w}-{r}"
        begin = t0 + 0.0005 * r
        emit(recorder, "preprocess", worker, begin - 0.0004, begin, request_id=rid, offset=0, prompt_tokens=120)
        request = child("request", worker, request_id=rid, offset=0)
        clock, tokens, turns = begin, 0, rng.choice((1, 2, 2, 3))
        for k in range(1, turns + 1):
            out = int(rng.expovariate(1 / 150)) + 1
            took = out * 0.02 * slow * rng.uniform(0.8, 1.2)
            turn = child("turn", request, turn=k)
            emit(
                recorder,
                "generate",
                turn,
                clock,
                clock + took,
                tokens_in=120 + tokens,
                tokens_out=out,
                finish_reason="stop",
            )
            tool = rng.uniform(0.01, 0.3)
            emit(recorder, "tool_call", turn, clock + took, clock + took + tool, tool="calculator")
            turn.start, turn.end = clock, clock + took + tool
            recorder.end(turn)
            clock, tokens = turn.end, tokens + out
        emit(recorder, "tool_reward", request, clock, clock + 0.01, tool="calculator")
        request.start, request.end = begin, clock + 0.01
        request.set(turns=turns, response_tokens=tokens, finish_reason="stop")
        recorder.end(request)
        end = max(end, request.end)
    emit(recorder, "padding", worker, end, end + 0.05, requests=requests)
    worker.end = end + 0.05
    recorder.end(worker)
    return worker.end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        written = write_logs(root / "profile", args.events, args.steps, args.workers)
        size = sum(p.stat().st_size for p in (root / "profile").rglob("*.jsonl")) / 1e6
        print(f"wrote {written:,} events ({size:.0f} MB, {args.steps} steps x {args.workers} workers + driver) "
              f"in {time.perf_counter() - start:.1f} s\n")  # fmt: skip
        rows = [run(root, written) for _ in range(args.repeat)]
    print(f"{'stage':<22}" + "".join(f"{'run ' + str(i + 1):>9}" for i in range(len(rows))))
    for stage in rows[0]:
        print(f"{stage:<22}" + "".join(f"{row[stage]:>8.2f}s" for row in rows))
    best = min(row["read + analyses"] for row in rows)
    print(f"\ntargets\n  read + analyses of {written:,} events in seconds (<= 10 s): {best:.2f} s -> "
          f"{'met' if best <= 10 else 'MISSED'}")  # fmt: skip


def run(root: Path, written: int) -> dict[str, float]:
    times = {}
    start = time.perf_counter()
    logs = read_logs(root / "profile")
    times["read"] = time.perf_counter() - start
    assert len(logs) == written, (len(logs), written)
    mark = time.perf_counter()
    result = analysis.analyze(logs)
    found = analysis.findings(result)
    times["analyses + findings"] = time.perf_counter() - mark
    times["read + analyses"] = time.perf_counter() - start
    assert any(f.kind == "straggler" and f.worker == 0 for f in found), [f.text for f in found]
    mark = time.perf_counter()
    write_report(logs, root / "report", analysis=result)
    times["report (PNG + HTML)"] = time.perf_counter() - mark
    mark = time.perf_counter()
    write_trace(logs, root / "trace.json")
    times["trace"] = time.perf_counter() - mark
    return times


if __name__ == "__main__":
    main()
