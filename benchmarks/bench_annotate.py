"""Per-call cost of ``@SkipManager.annotate`` on calls it lets through untouched.

Most decorated calls in a run are not replaced: the role is disabled, or the trainer step
is not one of ``skip.<role>.steps``. This measures what the decorator adds to such a call:

    plain        the undecorated function (baseline)
    disabled     role ``rollout`` registered but ``enable: false``
    ineligible   role ``rollout`` enabled, ``set_step`` to a step not in ``steps``

for a trivial function ``f()`` and for verl's call shape, a method taking a batch
(``rollout.generate_sequences(prompts)``), each as a plain function and as a coroutine
function (awaited inside one running event loop). verl 0.9.1's ``SkipManager`` is measured
side by side, in the same process and rounds, when ``verl.utils.skip`` imports; otherwise
the issue's reference numbers for it are printed, marked as such.

Times are per call and include the call itself; each is the minimum over ``--repeat``
rounds of ``--number`` calls, the rounds interleaving every variant in a new order.

Run: ``python benchmarks/bench_annotate.py --repeat 7``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skip_core import Batch, SkipManager

STEPS = [2, 4, 6, 8]
INELIGIBLE_STEP = 1
# The issue's numbers for verl 0.9.1 on this machine, per call including the call (ns).
VERL_REFERENCE = {"disabled": 350.0, "ineligible": 410.0}


def run_config(dump_dir: str, enable: bool) -> dict[str, Any]:
    """A run config as verl's trainer sees it; the same one drives both managers."""
    return {
        # trainer.v1.trainer_mode: verl 0.9.1's RolloutTqSkip reads it in init
        "trainer": {"experiment_name": "bench", "project_name": "annotate", "v1": {"trainer_mode": "sync"}},
        "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 16},
        "actor_rollout_ref": {"rollout": {"n": 1}},
        "skip": {"rollout": {"enable": enable, "dump_dir": dump_dir, "steps": STEPS, "action": "cache"}},
    }


class Managers:
    """skip's ``SkipManager`` and, where it imports, verl 0.9.1's, switched together."""

    def __init__(self, dump_dir: str, use_verl: bool) -> None:
        self.dump_dir = dump_dir
        self.verl = _import_verl() if use_verl else None

    def set_state(self, enable: bool) -> None:
        config = run_config(self.dump_dir, enable)
        SkipManager.init(config)
        SkipManager.set_step(INELIGIBLE_STEP)
        if self.verl is not None:
            from omegaconf import OmegaConf

            self.verl.init(OmegaConf.create(config))
            self.verl.set_step(INELIGIBLE_STEP)

    def managers(self) -> dict[str, Any]:
        found = {"skip": SkipManager}
        if self.verl is not None:
            found["verl 0.9.1"] = self.verl
        return found


def _import_verl() -> Any:
    # verl's own manager is the baseline: where skip-plugin-verl is installed it would serve it.
    os.environ["SKIP_PLUGINS"] = "skip-plugin-rollout"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.utils.skip import SkipManager as VerlSkipManager
    except Exception as exc:  # verl pulls in ray, tensordict, transformers: anything can fail
        print(f"verl.utils.skip does not import ({exc!r}); printing the issue's reference numbers instead")
        return None
    return VerlSkipManager


# -- the decorated code ---------------------------------------------------------------------


def f():
    return None


async def af():
    return None


class Rollout:
    def generate_sequences(self, prompts):
        return prompts

    async def agenerate_sequences(self, prompts):
        return prompts


def variants(managers: dict[str, Any]) -> dict[str, dict[str, Callable]]:
    """For each manager name (and ``plain``): the four callables under test."""
    out = {"plain": {"f": f, "af": af, "method": Rollout.generate_sequences, "amethod": Rollout.agenerate_sequences}}
    for name, manager in managers.items():
        annotate = manager.annotate(role="rollout")
        out[name] = {
            "f": annotate(f),
            "af": annotate(af),
            "method": annotate(Rollout.generate_sequences),
            "amethod": annotate(Rollout.agenerate_sequences),
        }
    return out


# -- timing ---------------------------------------------------------------------------------


def time_sync(fn: Callable, shape: str, number: int, prompts: Batch) -> float:
    """Seconds per call (timeit: GC off, loop in C-speed bytecode)."""
    if shape == "f":
        timer = timeit.Timer("fn()", globals={"fn": fn})
    else:
        rollout = type("DecoratedRollout", (), {"generate_sequences": fn})()
        timer = timeit.Timer("r.generate_sequences(p)", globals={"r": rollout, "p": prompts})
    return timer.timeit(number) / number


async def _await_loop(call: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        await call()
    return time.perf_counter() - start


def time_async(loop: asyncio.AbstractEventLoop, fn: Callable, shape: str, number: int, prompts: Batch) -> float:
    """Seconds per ``await`` of the coroutine function, all inside one running loop, GC off."""
    if shape == "af":
        call = fn
    else:
        rollout = type("DecoratedRollout", (), {"agenerate_sequences": fn})()

        def call():
            return rollout.agenerate_sequences(prompts)

    gc.disable()
    try:
        return loop.run_until_complete(_await_loop(call, number)) / number
    finally:
        gc.enable()


SHAPES = {
    "f": ("f()", "sync"),
    "method": ("rollout.generate_sequences(prompts)", "sync"),
    "af": ("await f()", "async"),
    "amethod": ("await rollout.generate_sequences(prompts)", "async"),
}
STATES = {"disabled": False, "ineligible": True}


def measure(managers: Managers, repeat: int, number: int, seed: int) -> dict[tuple[str, str, str], list[float]]:
    """``(shape, manager, state) -> seconds per call`` for every round; plain has state ``-``."""
    prompts = Batch.from_dict({}, {"raw_prompt": ["hello"] * 4}, {"validate": False, "global_steps": 1})
    callables = variants(managers.managers())
    loop = asyncio.new_event_loop()
    rng = random.Random(seed)
    times: dict[tuple[str, str, str], list[float]] = {}
    try:
        for _ in range(repeat):
            states = list(STATES)
            rng.shuffle(states)
            for state in states:  # one init per state and round; every variant runs under it
                managers.set_state(STATES[state])
                jobs = [(shape, name) for shape in SHAPES for name in callables]
                rng.shuffle(jobs)
                for shape, name in jobs:
                    fn = callables[name][shape]
                    if SHAPES[shape][1] == "sync":
                        seconds = time_sync(fn, shape, number, prompts)
                    else:
                        seconds = time_async(loop, fn, shape, number, prompts)
                    key = (shape, name, "-" if name == "plain" else state)
                    times.setdefault(key, []).append(seconds)
    finally:
        loop.close()
        SkipManager.reset()
    return times


def report(times: dict[tuple[str, str, str], list[float]], verl_measured: bool) -> list[str]:
    columns = ("call", "variant", "min ns", "median ns", "overhead ns (min)")
    lines = ["{:<44} {:<24} {:>8} {:>10} {:>18}".format(*columns)]
    for shape, (label, _) in SHAPES.items():
        plain = min(times[(shape, "plain", "-")])
        rows = [("plain", "-")] + [(n, s) for n in ("skip", "verl 0.9.1") for s in STATES]
        for name, state in rows:
            samples = times.get((shape, name, state))
            if samples is None:
                continue
            lo, med = min(samples) * 1e9, statistics.median(samples) * 1e9
            variant = name if state == "-" else f"{name}: {state}"
            overhead = "" if name == "plain" else f"{lo - plain * 1e9:+.0f}"
            lines.append(f"{label:<44} {variant:<24} {lo:>8.0f} {med:>10.0f} {overhead:>18}")
        lines.append("")
    lines.append("target: skip's overhead <= verl 0.9.1's, per call shape and state")
    for shape, (label, _) in SHAPES.items():
        plain = min(times[(shape, "plain", "-")])
        for state in STATES:
            ours = min(times[(shape, "skip", state)]) - plain
            if verl_measured:
                theirs = min(times[(shape, "verl 0.9.1", state)]) - plain
                source = "measured"
            elif shape == "f":
                theirs = VERL_REFERENCE[state] * 1e-9 - plain
                source = "issue's reference total - plain"
            else:
                continue
            verdict = "met" if ours <= theirs else "MISSED"
            versus = f"skip {ours * 1e9:+5.0f} ns, verl {theirs * 1e9:+5.0f} ns ({source})"
            lines.append(f"  {label:<44} {state:<11} {versus} {verdict}")
    lines.append("")
    totals = ", ".join(f"{state} {ns:.0f} ns" for state, ns in VERL_REFERENCE.items())
    lines.append(f"the issue's reference for verl 0.9.1, f() per-call totals on this machine: {totals}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of every variant (default 7)")
    parser.add_argument("--number", type=int, default=200_000, help="calls per timing (default 200000)")
    parser.add_argument("--no-verl", action="store_true", help="do not try to import verl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dump_dir = tempfile.mkdtemp(prefix="bench-annotate-")
    try:
        managers = Managers(str(Path(dump_dir)), use_verl=not args.no_verl)
        print(f"{args.repeat} rounds x {args.number:,} calls; steps {STEPS}, set_step({INELIGIBLE_STEP})")
        times = measure(managers, args.repeat, args.number, args.seed)
        print("\n".join(report(times, managers.verl is not None)))
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
