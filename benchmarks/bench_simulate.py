"""`skip simulate --from-profile` against the runs it predicts: the calibration check.

Trains the workload (`--config-name`, default `long_tail`) for real under `sync`,
`one_step_off` and `fully_async` with profiling on (hf backend, the default resources: one
rollout worker and one actor worker of one CPU each), then fits the simulator to the `sync`
run's profile and metrics and simulates the three schedules on the same run shape. Prints the
measured and predicted mean step times and their ratios to `sync`, and each ratio's error;
the target is within 15%. `--record DIR` also writes what the test of the calibration reads:
the `sync` profile's spans the fit uses, its metrics, and the measured step times.

    python benchmarks/bench_simulate.py --task-dir runs/embedded_long_tail      # about 5 minutes
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from skip_plugin_simulate.calibration import SCHEDULES

#: The spans the fit reads; the rest of a profile (tool lifecycle, padding) is left out of a record.
KEPT = ("request", "generate", "tool_call")


def train(directory: Path, task_dir: Path | None, schedule: str, args: argparse.Namespace) -> list[dict]:
    skip = Path(sys.executable).parent / "skip"
    run_dir = directory / schedule
    command = [
        str(skip), "run", "--config-name", args.config_name, f"trainer.schedule={schedule}",
        *([f"task.dir={task_dir}"] if task_dir else []),
        f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", "trainer.save_freq=-1",
        "profiling.enable=true",
    ]  # fmt: skip
    with open(directory / f"{schedule}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean_step(rows: list[dict]) -> float:
    steps = [row["timing_s/step"] for row in rows if row["step"] > 0]
    return sum(steps) / len(steps)


def simulated(profile: Path, metrics: Path, steps: int) -> dict[str, float]:
    """Mean step time per schedule, predicted from the profile."""
    from skip_plugin_simulate.calibration import predict_steps
    from skip_plugin_simulate.measured import read_profile

    return predict_steps(read_profile(profile, metrics), steps)


def record(directory: Path, run_dir: Path, measured: dict[str, float]) -> None:
    """The sync run's spans the fit reads (gzip JSON lines), its metrics and the measured times."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for path in sorted((run_dir / "profile").glob("*/worker_*.jsonl")):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            if span["event"] in KEPT or span["event"].startswith("trainer/"):
                lines.append(line)
    (directory / "spans.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    shutil.copy(run_dir / "metrics.jsonl", directory / "metrics.jsonl")
    (directory / "measured.json").write_text(json.dumps({"mean_step_s": measured}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="long_tail")
    parser.add_argument("--task-dir", type=Path, help="a built task to reuse")
    parser.add_argument("--record", type=Path, help="write the calibration test's data here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp:
        directory = Path(tmp)
        task_dir = args.task_dir.resolve() if args.task_dir else None
        rows = {name: train(directory, task_dir, name, args) for name in SCHEDULES}
        measured = {name: mean_step(r) for name, r in rows.items()}
        steps = max(row["step"] for row in rows["sync"])
        predicted = simulated(directory / "sync" / "profile", directory / "sync" / "metrics.jsonl", steps)
        if args.record:
            record(args.record, directory / "sync", measured)
    report(measured, predicted, args.config_name)


def report(measured: dict[str, float], predicted: dict[str, float], workload: str) -> None:
    table = Table(title=f"{workload}: measured runs against skip simulate --from-profile (the sync run's)")
    for column in ("schedule", "measured step", "predicted step", "measured / sync", "predicted / sync", "error"):
        table.add_column(column, justify="right")
    for name in SCHEDULES:
        real, model = measured[name] / measured["sync"], predicted[name] / predicted["sync"]
        table.add_row(
            name,
            f"{measured[name]:.2f} s",
            f"{predicted[name]:.2f} s",
            f"{real:.2f}",
            f"{model:.2f}",
            f"{model / real - 1:+.0%}",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
