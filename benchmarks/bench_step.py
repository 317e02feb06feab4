"""Per-phase step time of `skip run` on the embedded default, without and with a rollout cache hit.

Runs the main job twice in one invocation, in a temporary directory: first generating and dumping
every step's rollout, then the same run replaying them from the skip cache. Prints the mean
seconds per phase over the steps of each run and the share of `gen` in the step.

With `--actor-workers`, what sharding the policy costs per step: after the run that generates and
dumps, one run per N replaying every rollout from that cache (so generation does not blur the
comparison) with `resources.actor.workers=N` (FSDP2 over N ranks, sharing `resources.actor.cpus`).
Prints one table, a column per N, and each N's ratio to the first; with `--rounds`, the runs of
every N alternate in a new random order each round and the table gives the medians.

    python benchmarks/bench_step.py --steps 10
    python benchmarks/bench_step.py --steps 6 --actor-workers 1 2
    python benchmarks/bench_step.py --steps 6 --actor-workers 1 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from skip_core.schedule import GEN, STEP, WEIGHT_SYNC

PHASES = (GEN, "reward", "old_log_prob", "ref", "adv", "update_actor", WEIGHT_SYNC, STEP)
SHARDED = (GEN, "old_log_prob", "update_actor", WEIGHT_SYNC, STEP)  # what --actor-workers compares


def train(directory: Path, task_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    skip = Path(sys.executable).parent / "skip"
    overrides = [
        f"task.dir={task_dir}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={directory / 'run'}",
        f"skip.rollout.dump_dir={directory / 'cache'}",
        f"skip.rollout.steps=[{','.join(str(s) for s in range(1, steps + 1))}]",
        "skip.rollout.enable=true",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        *extra,
    ]
    done = subprocess.run([str(skip), "run", *overrides], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"skip run {' '.join(extra)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = (directory / "run" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["step"] > 0]


def means(rows: list[dict]) -> dict[str, float]:
    return {p: sum(r.get(f"timing_s/{p}", 0.0) for r in rows) / len(rows) for p in PHASES}


def sharded(args: argparse.Namespace) -> None:
    """One generating run, then ``--rounds`` rounds of one replaying run per ``--actor-workers`` N
    (in a new random order each round); one table of the medians over the rounds."""
    workers: list[int] = args.actor_workers
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in workers}
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        task_dir = (args.task_dir or Path(tmp) / "embedded").absolute()
        train(Path(tmp), task_dir, args.steps, args.overrides)  # fills the cache
        for _ in range(args.rounds):
            for n in random.sample(workers, len(workers)):
                rows = train(Path(tmp), task_dir, args.steps, [*args.overrides, f"resources.actor.workers={n}"])
                runs[n].append(means(rows))
    base = workers[0]
    rounds = f", median (min-max) of {args.rounds} rounds" if args.rounds > 1 else ""
    table = Table(title=f"skip run replaying its rollouts, mean seconds per step over {args.steps} steps{rounds}")
    table.add_column("phase", justify="right")
    for n in workers:
        table.add_column(f"{n} worker{'s' if n > 1 else ''}", justify="right")
    for n in workers[1:]:
        table.add_column(f"ratio {n} / {base}", justify="right")
    for phase in SHARDED:
        values = {n: [run[phase] for run in runs[n]] for n in workers}
        medians = {n: statistics.median(values[n]) for n in workers}
        cells = [
            f"{medians[n]:.3f}" + (f" ({min(values[n]):.3f}-{max(values[n]):.3f})" if args.rounds > 1 else "")
            for n in workers
        ]
        ratios = [f"{medians[n] / medians[base]:.2f}x" if medians[base] > 0 else "-" for n in workers[1:]]
        table.add_row("gen (cache load)" if phase == GEN else phase, *cells, *ratios)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--task-dir", type=Path, default=None, help="a built embedded default to reuse (default: built in a temp dir)"
    )
    parser.add_argument(
        "--actor-workers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="replay the cached rollouts once per N with resources.actor.workers=N and compare the phases "
        "(put overrides before this option)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="with --actor-workers: replaying runs per N, interleaved (median)"
    )
    parser.add_argument("overrides", nargs="*", help="extra `skip run` overrides, e.g. rollout.n=8")
    args = parser.parse_args()
    if args.actor_workers:
        sharded(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        task_dir = (args.task_dir or Path(tmp) / "embedded").absolute()
        generated = means(train(Path(tmp), task_dir, args.steps, args.overrides))
        replayed = means(train(Path(tmp), task_dir, args.steps, args.overrides))
    table = Table(title=f"skip run, mean seconds per step over {args.steps} steps")
    for column in ("phase", "generated", "cache hit", "ratio"):
        table.add_column(column, justify="right")
    for phase in PHASES:
        a, b = generated[phase], replayed[phase]
        table.add_row(phase, f"{a:.3f}", f"{b:.3f}", f"{a / b:.1f}x" if b > 0 else "-")
    table.add_row(
        "gen share of step", f"{generated['gen'] / generated['step']:.0%}", f"{replayed['gen'] / replayed['step']:.0%}"
    )
    Console().print(table)


if __name__ == "__main__":
    main()
