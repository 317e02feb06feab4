"""`sync`, `one_step_off` and `fully_async` on the same `skip run`, one after the other.

Trains the embedded default once per schedule in one invocation (same config, data, seeds and
built task), in a temporary directory, and prints per schedule: mean step time, mean
`timing_s/gen` (the trainer's wait for rollouts), the ideal overlap measured from the sync run
(mean over steps of max(gen, rest of the step): what a perfect one-step-off could reach),
validation scores, the validation gain per minute of training, and the total training time.
Wall time is the sum of the steps' `timing_s/step` (Ray and model start-up left out, the same
for every schedule). One plot, validation score against training time for the three, goes to
`--plot` (default: beside the runs in the temporary directory, kept with `--keep`).

    python benchmarks/bench_schedules.py --steps 24
    python benchmarks/bench_schedules.py --steps 24 --task-dir runs/embedded --plot schedules.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONFIGS = Path(__file__).parent.parent / "configs"
SCHEDULES = ("sync", "one_step_off", "fully_async")


def train(directory: Path, task_dir: Path, schedule: str, steps: int, extra: list[str]) -> list[dict]:
    skip = Path(sys.executable).parent / "skip"
    overrides = [
        f"task.dir={task_dir}",
        f"trainer.schedule={schedule}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={directory / schedule}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        *extra,
    ]
    subprocess.run([str(skip), "run", "--config-dir", str(CONFIGS), *overrides], check=True, capture_output=True)
    return [json.loads(line) for line in (directory / schedule / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if r["step"] > 0]
    total = sum(r["timing_s/step"] for r in steps)
    vals = [(0.0, r["val/score/mean"]) for r in rows if r["step"] == 0 and "val/score/mean" in r]
    elapsed = 0.0
    for r in steps:
        elapsed += r["timing_s/step"]
        if "val/score/mean" in r:
            vals.append((elapsed, r["val/score/mean"]))
    gain = (vals[-1][1] - vals[0][1]) / (total / 60) if len(vals) > 1 and total > 0 else float("nan")
    return {
        "step": total / len(steps),
        "gen": sum(r["timing_s/gen"] for r in steps) / len(steps),
        "ideal": sum(max(r["timing_s/gen"], r["timing_s/step"] - r["timing_s/gen"]) for r in steps) / len(steps),
        "first_val": vals[0][1] if vals else float("nan"),
        "last_val": vals[-1][1] if vals else float("nan"),
        "gain_per_min": gain,
        "total": total,
        "curve": vals,
    }


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for schedule, result in results.items():
        times, scores = zip(*result["curve"], strict=True) if result["curve"] else ((), ())
        ax.plot([t / 60 for t in times], scores, marker="o", label=schedule)
    ax.set_xlabel("training time (min)")
    ax.set_ylabel("validation score")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--task-dir", type=Path, default=None, help="a built embedded default to reuse")
    parser.add_argument("--plot", type=Path, default=None, help="where to write the score/time plot")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directory and print it")
    parser.add_argument("overrides", nargs="*", help="extra `skip run` overrides for all three, e.g. rollout.n=8")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-schedules-"))
    try:
        task_dir = (args.task_dir or directory / "embedded").absolute()
        results = {s: summary(train(directory, task_dir, s, args.steps, args.overrides)) for s in SCHEDULES}
        report(results, args.steps)
        path = args.plot or directory / "schedules.png"
        plot(results, path)
        print(f"plot: {path}")
    finally:
        if args.keep or args.plot is None:
            print(f"runs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


def report(results: dict[str, dict], steps: int) -> None:
    ideal = results["sync"]["ideal"]
    table = Table(title=f"skip run, {steps} steps per schedule (seconds; wall = sum of step times)")
    for column in ("schedule", "mean step", "gen (wait)", "vs ideal overlap", "val first → last", "val/min", "wall"):
        table.add_column(column, justify="right")
    for schedule, r in results.items():
        table.add_row(
            schedule,
            f"{r['step']:.2f}",
            f"{r['gen']:.2f}",
            f"{r['step'] / ideal:.2f}x" if schedule != "sync" else f"ideal {ideal:.2f}",
            f"{r['first_val']:.3f} → {r['last_val']:.3f}",
            f"{r['gain_per_min']:+.3f}",
            f"{r['total']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
