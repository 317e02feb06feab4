"""Per-event cost of profiling: skip's spans against the article's logger, side by side.

The article's logger (``SGLangLogManager.log`` in the profiling article) builds a dict per
event, ``json.dumps`` it and writes and flushes a line-buffered file before returning. It is
re-implemented here from that description (``ArticleLogger``). Variants, per event:

    article          ArticleLogger.log(path, event, duration, extra={request_id}, workid, step)
    article+clock    the article's call site: two time.time() around the work, then log(...)
    sink.end         skip-plugin-profiling's hot path: Recorder.end(span) (queue append)
    span             what instrumented code pays: ``with spans.span("generate", tokens_in=..)``
                     inside a request span (clock twice, context inheritance, sink)
    record           spans.record("barrier_wait", start, end, workid=..) (measured apart)
    span, no sink    ``spans.span`` while profiling is off

Then the work moved off the hot path (``flush`` of queued spans: JSON lines and one write
per file, per event), and end to end: emitting events with the background writer running
and closing it, total wall time per event.

Times are per event: the minimum and median over ``--repeat`` rounds of ``--number`` events,
every round running all variants in a new random order.

Run: ``python benchmarks/bench_profiling.py --repeat 7``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from skip_core import spans
from skip_plugin_profiling.recorder import Recorder


class ArticleLogger:
    """The article's logger: one JSON line written and flushed per event, handles kept open."""

    def __init__(self) -> None:
        self.handles: dict[str, object] = {}

    def handle(self, path: str):
        if path not in self.handles:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.handles[path] = open(path, "a", buffering=1)  # noqa: SIM115
        return self.handles[path]

    def log(self, path, event, duration=None, extra=None, workid=None, step=None, **keys):
        entry = {"timestamp": datetime.now().isoformat(), "event": event}
        if duration is not None:
            entry["duration_sec"] = duration
        if extra is not None:
            entry["extra"] = extra
        if workid is not None:
            entry["workid"] = workid
        if step is not None:
            entry["step"] = step
        entry.update(keys)
        first = ["timestamp", "event", "duration_sec"]
        ordered = {k: entry[k] for k in first + [k for k in entry if k not in first] if k in entry}
        handle = self.handle(path)
        handle.write(json.dumps(ordered) + "\n")
        handle.flush()

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def variants(root: Path) -> tuple[dict[str, Callable[[int], float]], Callable[[], None]]:
    """Each variant runs ``n`` events and returns the seconds they took."""
    article = ArticleLogger()
    path = str(root / "article" / "step_1" / "worker_0.jsonl")
    recorder = Recorder(root / "skip", worker=0, flush_interval_s=3600)  # drained between rounds, untimed
    request_id = "651c26c88e53421585d6855ed2144658"

    def run_article(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            article.log(path, "engine_async_generate", 0.0123, extra={"request_id": request_id}, workid=0, step=1)
        return time.perf_counter() - start

    def run_article_clock(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.time()
            article.log(path, "engine_async_generate", time.time() - t0, {"request_id": request_id}, 0, 1)
        return time.perf_counter() - start

    def in_request(body: Callable[[int], float]) -> Callable[[int], float]:
        def run(n: int) -> float:
            spans.close()
            spans.attach(recorder)
            with spans.span("request", step=1, request_id=request_id):
                seconds = body(n)
            recorder._queue.clear()
            return seconds

        return run

    def run_end(n: int) -> float:
        with spans.span("generate") as span:
            pass
        end = recorder.end
        start = time.perf_counter()
        for _ in range(n):
            end(span)
        return time.perf_counter() - start

    def run_span(n: int) -> float:
        span = spans.span
        start = time.perf_counter()
        for _ in range(n):
            with span("generate", tokens_in=120):
                pass
        return time.perf_counter() - start

    def run_record(n: int) -> float:
        record = spans.record
        start = time.perf_counter()
        for _ in range(n):
            record("barrier_wait", 1.0, 2.0, workid=0)
        return time.perf_counter() - start

    def run_off(n: int) -> float:
        spans.close()
        return run_span(n)

    table = {
        "article": run_article,
        "article+clock": run_article_clock,
        "sink.end": in_request(run_end),
        "span": in_request(run_span),
        "record": in_request(run_record),
        "span, no sink": run_off,
    }

    def close() -> None:
        article.close()
        recorder.close()

    return table, close


def background(root: Path, n: int) -> float:
    """Seconds per event the writer thread spends turning queued spans into lines on disk."""
    recorder = Recorder(root / "background", worker=0, flush_interval_s=3600)
    spans.close()
    spans.attach(recorder)
    with spans.span("request", step=1, request_id="651c26c88e53421585d6855ed2144658"):
        for _ in range(n):
            with spans.span("generate", tokens_in=120) as span:
                span.set(tokens_out=31, finish_reason="stop")
    start = time.perf_counter()
    recorder.flush()
    seconds = time.perf_counter() - start
    spans.close()
    return seconds / n


def end_to_end(root: Path, n: int, skip: bool) -> float:
    """Wall seconds per event to emit ``n`` events and have them all on disk."""
    start = time.perf_counter()
    if skip:
        recorder = Recorder(root / "e2e", worker=0)
        spans.close()
        spans.attach(recorder)
        with spans.span("request", step=1, request_id="651c26c88e53421585d6855ed2144658"):
            for _ in range(n):
                with spans.span("generate", tokens_in=120):
                    pass
        spans.close()
    else:
        article = ArticleLogger()
        path = str(root / "e2e-article" / "step_1" / "worker_0.jsonl")
        for _ in range(n):
            t0 = time.time()
            article.log(path, "engine_async_generate", time.time() - t0, {"request_id": "651c"}, 0, 1)
        article.close()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        root = Path(tmp)
        table, close = variants(root)
        times: dict[str, list[float]] = {name: [] for name in table}
        gc.disable()
        for _ in range(args.repeat):
            for name in random.sample(list(table), len(table)):
                times[name].append(table[name](args.number) / args.number)
        gc.enable()
        close()
        drain = min(background(root, args.number) for _ in range(3))
        e2e = {n: min(end_to_end(root, args.number, n == "skip") for _ in range(3)) for n in ("article", "skip")}

    article = min(times["article+clock"])
    print(f"per event, {args.repeat} rounds of {args.number:,} events (microseconds)\n")
    print(f"{'variant':<16}{'min':>8}{'median':>9}{'vs article+clock':>18}")
    for name, values in times.items():
        best = min(values)
        print(f"{name:<16}{best * 1e6:>8.3f}{statistics.median(values) * 1e6:>9.3f}{article / best:>17.1f}x")
    print(f"\noff the hot path, writer thread: {drain * 1e6:.3f} us per event (JSON line + write)")
    print(
        f"end to end, {args.number:,} events emitted and on disk: article {e2e['article'] * 1e6:.3f} us, "
        f"skip {e2e['skip'] * 1e6:.3f} us per event ({e2e['article'] / e2e['skip']:.1f}x)"
    )
    span = min(times["span"])
    print("\ntargets")
    print(f"  span <= 1 us per event: {span * 1e6:.3f} us -> {'met' if span <= 1e-6 else 'MISSED'}")
    ratio = article / span
    print(f"  span >= 6x cheaper than the article's logger: {ratio:.1f}x -> {'met' if ratio >= 6 else 'MISSED'}")


if __name__ == "__main__":
    main()
