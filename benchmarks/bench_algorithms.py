"""Does the embedded default learn under verl's other algorithms as under GRPO?

Runs `skip run` at its defaults (20 steps, greedy validation before training and every 2 steps)
once per algorithm, in a temporary run directory each, the embedded task built once and shared,
and prints the greedy validation score before training, at the last step and at its best, with
the mean step time:

- `grpo`: the default (GRPO's advantages, PPO's clipped loss);
- `gspo`: GSPO's sequence-level ratio (`actor.policy_loss.loss_mode=gspo`, with verl's
  `loss_agg_mode=seq-mean-token-mean` and GSPO's own clip bounds, 3e-4 / 4e-4, as verl's script);
- `cispo`: CISPO's clipped, detached ratio weighting -A log pi (bounds 0.2 / 0.28);
- `remax`: ReMax's advantages, each prompt's greedy response as its baseline.

    python benchmarks/bench_algorithms.py                      # all four, 20 steps each
    python benchmarks/bench_algorithms.py --only gspo --steps 10 --task-dir ./runs/embedded
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
ALGORITHMS = {
    "grpo": [],
    "gspo": [
        "actor.policy_loss.loss_mode=gspo",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.clip_ratio_low=3e-4",
        "actor.clip_ratio_high=4e-4",
    ],
    "cispo": ["actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28"],
    "remax": ["algorithm.adv_estimator=remax"],
}


def run(name: str, overrides: list[str], task_dir: Path, directory: Path, steps: int) -> dict:
    run_dir = directory / name
    command = [
        str(SKIP), "run", *overrides, f"task.dir={task_dir}", f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=true", "trainer.save_freq=-1",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{name}: skip run exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validation = {row["step"]: row["val/score/mean"] for row in rows if "val/score/mean" in row}
    step_s = [row["timing_s/step"] for row in rows if "timing_s/step" in row]
    return {
        "before": validation[0],
        "last": validation[max(validation)],
        "best": max(validation.values()),
        "step_s": statistics.mean(step_s),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(ALGORITHMS), action="append", help="run these alone")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--task-dir", type=Path, help="the embedded task's directory, built there once (default: new)")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="skip-bench-algorithms-") as tmp:
        directory = Path(tmp)
        table = Table(title=f"greedy validation of the embedded default, {args.steps} steps")
        for column in ("algorithm", "before", f"step {args.steps}", "best", "mean step s", "run s"):
            table.add_column(column, justify="left" if column == "algorithm" else "right")
        for name in args.only or ALGORITHMS:
            console.print(f"{name} ...")
            result = run(name, ALGORITHMS[name], args.task_dir or directory / "task", directory, args.steps)
            table.add_row(
                name, f"{result['before']:.4f}", f"{result['last']:.4f}", f"{result['best']:.4f}",
                f"{result['step_s']:.2f}", f"{result['wall_s']:.0f}",
            )  # fmt: skip
        console.print(table)


if __name__ == "__main__":
    main()
