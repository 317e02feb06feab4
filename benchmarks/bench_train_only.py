"""Rollout-only, then train-only, on the embedded default: `skip run`'s time to step 1 with and without its engine.

Fills a skip cache with `skip rollout steps=1..N` (rollout-only: the run's prompts and seeds, the
starting weights), then runs the same `skip run` in alternating rounds:

- train-only: every step is in the cache and nothing validates, so no rollout engine starts;
- engines: the same run with step N left out of `skip.rollout.steps`, so it needs an engine and
  starts it before step 1, as every run that generates does.

Time to step 1 is from launching `skip run` to step 1's line in its metrics.jsonl; the difference is
what the engine's start costs a run that would not use it.

    python benchmarks/bench_train_only.py --backend vllm --steps 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SKIP = Path(sys.executable).parent / "skip"


def common(tmp: Path, task_dir: Path, backend: str, steps: int) -> list[str]:
    return [
        f"task.dir={task_dir}",
        f"rollout.backend={backend}",
        "skip.rollout.enable=true",
        f"skip.rollout.dump_dir={tmp / 'cache'}",
        f"trainer.total_training_steps={steps}",
    ]


def fill(tmp: Path, overrides: list[str], steps: int) -> float:
    start = time.perf_counter()
    subprocess.run([str(SKIP), "rollout", *overrides, f"steps=1..{steps}"], check=True, capture_output=True)
    return time.perf_counter() - start


def time_to_step_1(run_dir: Path, overrides: list[str]) -> tuple[float, float, str]:
    """Seconds from launch to step 1's metrics line, seconds to exit, and the run's first lines."""
    more = [f"trainer.default_local_dir={run_dir}", "trainer.test_freq=0", "trainer.save_freq=-1"]
    start = time.perf_counter()
    process = subprocess.Popen(
        [str(SKIP), "run", *overrides, *more], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first = None
    metrics = run_dir / "metrics.jsonl"
    while process.poll() is None and first is None:
        if metrics.exists() and any(json.loads(line)["step"] == 1 for line in metrics.read_text().splitlines()):
            first = time.perf_counter() - start
        time.sleep(0.05)
    output, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"skip run failed:\n{output}")
    if first is None:  # finished between two looks
        first = time.perf_counter() - start
    return first, time.perf_counter() - start, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--task-dir", type=Path, default=None, help="a built embedded default to reuse")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-train-only-") as name:
        tmp = Path(name)
        task_dir = (args.task_dir or tmp / "embedded").absolute()
        overrides = common(tmp, task_dir, args.backend, args.steps)
        filled = fill(tmp, overrides, args.steps)
        modes = {
            "train-only": [],
            "engines": [f"skip.rollout.steps=1..{args.steps - 1}"],
        }
        times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        for round in range(args.rounds):
            for mode, more in modes.items():
                first, total, output = time_to_step_1(tmp / f"{mode}-{round}", [*overrides, *more])
                if (mode == "train-only") != ("train-only:" in output):
                    raise SystemExit(f"{mode}: the run did not plan its engines as expected:\n{output}")
                times[mode].append((first, total))
    table = Table(title=f"skip run, {args.backend}, {args.steps} steps cached by skip rollout ({filled:.1f} s)")
    for column in ("run", "time to step 1 (s), median", "min-max", "whole run (s), median"):
        table.add_column(column, justify="right")
    for mode, runs in times.items():
        firsts = [first for first, _ in runs]
        table.add_row(
            mode,
            f"{statistics.median(firsts):.1f}",
            f"{min(firsts):.1f}-{max(firsts):.1f}",
            f"{statistics.median(total for _, total in runs):.1f}",
        )
    saved = statistics.median(f for f, _ in times["engines"]) - statistics.median(f for f, _ in times["train-only"])
    Console().print(table)
    Console().print(f"train-only reaches step 1 {saved:.1f} s sooner ({args.rounds} rounds, alternating)")


if __name__ == "__main__":
    main()
