"""`sync`, `one_step_off` and `fully_async` on the same `skip run`, one after the other.

Trains a workload (`--config-name`, default `run`: the embedded default; `long_tail`: the
generation-bound one) on a rollout backend (`--backend`, default `hf`) with each schedule in
one invocation (same config, data, seeds, built task and total CPUs: `sync` gives every phase
all of them, the overlapped schedules split them into pools), `--rounds` times in a new random
order each round, in a temporary directory, and prints per schedule (medians over the rounds):
mean step time, trained samples per second, mean `timing_s/gen` (the trainer's wait for
rollouts), the rollout workers' idle ratio, validation scores, the validation gain per minute
of training, and the total training time. `sync` runs twice: with every CPU for each worker in
turn (its default), and with each worker at the torch threads the overlapped schedules give it
(its pool's CPUs, `--pool-threads`). The ideal overlap, the mean over steps of max(gen, rest of
the step), is measured on both; the second (which also takes the rollout log-probs as old
ones, as the overlapped schedules do) is what a perfect one-step-off can reach on the same
split of the machine, and the overlapped schedules are compared to it. Wall time is the sum
of the steps' `timing_s/step` (Ray and model start-up left out, the same for every schedule).
One plot, validation score against training time for the three, goes to `--plot` (default:
beside the runs in the temporary directory, kept with `--keep`).

The rollout idle ratio: `sync`, 1 - gen / step (the engines wait while the trainer works);
`one_step_off`, 1 - generation's own time in the background / step; `fully_async`, the
rollouter's own measure (`fully_async/rollouter/idle_ratio`: time with nothing to generate).
The cores each process used while the run trained come from `cpu_use.py`: which side saturates.

    python benchmarks/bench_schedules.py                  # 20 steps, 2 rounds: about 8 minutes
    python benchmarks/bench_schedules.py --config-name long_tail --rounds 1   # about 6 minutes
    python benchmarks/bench_schedules.py --config-name long_tail --backend vllm --plot schedules.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from cpu_use import CpuUse
from rich.console import Console
from rich.table import Table

POOLED = "sync, pool threads"
# The bound on the final validation score (mean of the last two) against sync's; about
# one standard error of a mean over 64 validation prompts near 0.9 is 0.04.
SCORE_NOISE = 0.05


def runs(pool_threads: int) -> dict[str, list[str]]:
    """Each row's name and its schedule's overrides."""
    return {
        "sync": ["trainer.schedule=sync"],
        # The same work as the overlapped schedules do, one after the other: their threads and
        # their old log-probs (the rollout's, so no recomputation).
        POOLED: [
            "trainer.schedule=sync",
            f"resources.torch_threads={pool_threads}",
            "algorithm.rollout_correction.bypass_mode=true",
        ],
        "one_step_off": ["trainer.schedule=one_step_off"],
        "fully_async": ["trainer.schedule=fully_async"],
    }


def train(
    directory: Path, task_dir: Path, name: str, schedule: list[str], args: argparse.Namespace
) -> tuple[list[dict], dict[str, float]]:
    """``skip run`` of the workload on the backend with this schedule and the user's overrides
    (last): its metrics rows, and the cores each of its processes used while it trained."""
    skip = Path(sys.executable).parent / "skip"
    run_dir = directory / name.replace(", ", "-").replace(" ", "_")
    shutil.rmtree(run_dir, ignore_errors=True)  # the previous round's
    overrides = [
        "--config-name",
        args.config_name,
        f"rollout.backend={args.backend}",
        f"task.dir={task_dir}",
        *schedule,
        *([f"trainer.total_training_steps={args.steps}"] if args.steps else []),
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        *args.overrides,
    ]
    cores = CpuUse(run_dir / "metrics.jsonl").run([str(skip), "run", *overrides], directory / f"{run_dir.name}.log")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], cores


def samples_per_step(config_name: str, overrides: list[str]) -> int:
    """Prompts x samples per prompt of one training step, from the config the runs compose."""
    from skip_plugin_trainer.commands import compose_config

    config = compose_config(None, config_name, tuple(overrides))
    return config.data.train_batch_size * config.rollout.n


def rollout_idle(row: dict) -> float:
    if "fully_async/rollouter/idle_ratio" in row:
        return row["fully_async/rollouter/idle_ratio"]
    busy = row.get("timing_s/generate_async", row["timing_s/gen"])
    return max(0.0, 1 - busy / row["timing_s/step"])


def summary(rows: list[dict], cores: dict[str, float], samples: int) -> dict[str, float]:
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
        "samples_per_s": samples * len(steps) / total,
        "gen": sum(r["timing_s/gen"] for r in steps) / len(steps),
        "idle": sum(map(rollout_idle, steps)) / len(steps),
        "ideal": sum(max(r["timing_s/gen"], r["timing_s/step"] - r["timing_s/gen"]) for r in steps) / len(steps),
        "first_val": vals[0][1] if vals else float("nan"),
        "last_val": vals[-1][1] if vals else float("nan"),
        "final": sum(v for _, v in vals[-2:]) / len(vals[-2:]) if vals else float("nan"),
        "gain_per_min": gain,
        "total": total,
        **engine(steps, total),
        **{f"cores_{role}": used for role, used in cores.items()},
        "curve": vals,
    }


def engine(steps: list[dict], total: float) -> dict[str, float]:
    """The engine's own account (hf counts it, `rollout/engine/*`): its mean running batch, and
    the share of the run its forward passes took, summed over the rollout workers."""
    passes = sum(r.get("rollout/engine/decode_passes", 0) for r in steps)
    if not passes:
        return {}
    rows = sum(r["rollout/engine/decode_rows"] for r in steps)
    return {"batch_rows": rows / passes, "engine_busy": sum(r["rollout/engine/forward_s"] for r in steps) / total}


def median(rounds: list[dict]) -> dict:
    """Each number's median over the rounds; the curve of the round with the median wall time."""
    middle = sorted(rounds, key=lambda r: r["total"])[len(rounds) // 2]
    keys = [key for key in middle if key != "curve"]
    numbers = {key: statistics.median(r.get(key, math.nan) for r in rounds) for key in keys}
    return {**numbers, "curve": middle["curve"]}


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
    parser.add_argument("--config-name", default="run", help="the workload: run (default) or long_tail")
    parser.add_argument("--backend", default="hf", help="rollout.backend for all three (default hf)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the workload's own)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per schedule, in a new random order each round")
    parser.add_argument("--task-dir", type=Path, default=None, help="a built embedded default to reuse")
    parser.add_argument("--plot", type=Path, default=None, help="where to write the score/time plot")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directory and print it")
    parser.add_argument("--pool-threads", type=int, default=1, help="torch threads per worker in the pools")
    parser.add_argument("overrides", nargs="*", help="extra `skip run` overrides for all three, e.g. rollout.n=8")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-schedules-"))
    try:
        task_dir = (args.task_dir or directory / "embedded").absolute()
        samples = samples_per_step(args.config_name, args.overrides)
        schedules = runs(args.pool_threads)
        rounds: dict[str, list[dict]] = {name: [] for name in schedules}
        for number in range(args.rounds):
            order = random.sample(list(schedules), len(schedules))
            print(f"round {number + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for name in order:
                rows, cores = train(directory, task_dir, name, schedules[name], args)
                rounds[name].append(summary(rows, cores, samples))
        results = {name: median(found) for name, found in rounds.items()}
        report(results, f"skip run --config-name {args.config_name}, backend {args.backend}", args)
        path = args.plot or directory / "schedules.png"
        plot(results, path)
        print(f"plot: {path}")
    finally:
        if args.keep or args.plot is None:
            print(f"runs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


def report(results: dict[str, dict], workload: str, args: argparse.Namespace) -> None:
    ideal = results[POOLED]["ideal"]
    steps = f"{args.steps} steps" if args.steps else "the workload's steps"
    title = f"{workload}: {steps} per schedule, median of {args.rounds} rounds (seconds; wall: sum of steps)"
    table = Table(title=title)
    columns = ("schedule", "mean step", "samples/s", "gen (wait)", "rollout idle", "ideal overlap", "step / ideal")
    cores = "cores: rollout / actor / driver+ray (machine)"
    for column in (*columns, "val first → last", "val gain/min", "wall", "engine: rows/pass, busy", cores):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['step']:.2f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['gen']:.2f}",
            f"{r['idle']:.0%}",
            f"{r['ideal']:.2f}" if name.startswith("sync") else "",
            f"{r['step'] / ideal:.2f}x" if not name.startswith("sync") else "",
            f"{r['first_val']:.3f} → {r['last_val']:.3f}",
            f"{r['gain_per_min']:+.3f}",
            f"{r['total']:.1f}",
            f"{r['batch_rows']:.1f}, {r['engine_busy']:.0%}" if "batch_rows" in r else "",
            _cores(r),
        )
    Console(width=200).print(table)
    print("targets")
    for name, ok, text in targets(results):
        print(f"  {name}: {text} -> {'met' if ok else 'MISSED'}")


def _cores(r: dict) -> str:
    if "cores_machine" not in r:
        return "(too few steps)"
    others = r["cores_driver"] + r["cores_ray"]
    return f"{r['cores_rollout']:.2f} / {r['cores_actor']:.2f} / {others:.2f} ({r['cores_machine']:.2f})"


def targets(results: dict[str, dict]) -> list[tuple[str, bool, str]]:
    """The targets of issue 23 (throughput ratios on the long tail; the score kept), and the overlap."""
    ideal = results[POOLED]["ideal"]
    one, full, sync = results["one_step_off"], results["fully_async"], results["sync"]

    def speedup(name: str, a: dict, b: dict, target: float) -> tuple[str, bool, str]:
        ratio = a["samples_per_s"] / b["samples_per_s"]
        return name, ratio >= target, f"{ratio:.2f}x ({a['samples_per_s']:.1f} vs {b['samples_per_s']:.1f} samples/s)"

    found = [
        speedup("fully_async >= 1.5x sync's throughput", full, sync, 1.5),
        speedup("fully_async >= 1.15x one_step_off's throughput", full, one, 1.15),
        speedup("one_step_off >= 1.2x sync's throughput", one, sync, 1.2),
        ("one_step_off within 5% of the ideal overlap", one["step"] <= 1.05 * ideal, f"{one['step'] / ideal:.2f}x"),
    ]
    for name in ("one_step_off", "fully_async"):
        final = results[name]["final"]
        text = f"final score (mean of the last two validations) {final:.3f} vs sync {sync['final']:.3f}"
        found.append((f"{name} keeps sync's score within {SCORE_NOISE}", final >= sync["final"] - SCORE_NOISE, text))
    return found


if __name__ == "__main__":
    main()
