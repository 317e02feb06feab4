"""What skip-plugin-verl costs a verl process: its start-up hook, importing ``verl.utils.skip``,
and ``SkipManager.init``, with the bridge on and off (``SKIP_PLUGINS`` without it).

Run with the interpreter of a venv that has verl 0.9.1 and skip-plugin-verl installed (the
README's two install lines):

    python benchmarks/bench_verl_bridge.py --repeat 9

Each round starts a fresh interpreter per variant, in a new order; a child times its own
import and init (``time.perf_counter``), and ``-X importtime`` gives the start-up hook's share.
Medians over the rounds are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from verl.utils.skip import SkipManager
t1 = time.perf_counter()
from omegaconf import OmegaConf
config = OmegaConf.create({
    "trainer": {"experiment_name": "bench", "project_name": "bridge", "v1": {"trainer_mode": "sync"}},
    "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 16},
    "actor_rollout_ref": {"rollout": {"n": 1}},
    "skip": {"rollout": {"enable": True, "dump_dir": sys.argv[1], "steps": [1], "action": "cache"}},
})
t2 = time.perf_counter()
SkipManager.init(config)
t3 = time.perf_counter()
print(json.dumps({"served_by": getattr(SkipManager, "served_by", None), "import": t1 - t0, "init": t3 - t2}))
"""
VARIANTS = {"bridge on": None, "bridge off": "skip-plugin-rollout,skip-plugin-async-rollout"}


def child(plugins: str | None, dump_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SKIP_PLUGINS"}
    if plugins is not None:
        env["SKIP_PLUGINS"] = plugins
    done = subprocess.run([sys.executable, "-c", CHILD, dump_dir], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def startup_hook_us() -> int:
    """Cumulative import time of the start-up hook in an interpreter that runs nothing."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True)
    for line in done.stderr.splitlines():
        if line.rstrip().endswith("skip_plugin_verl.startup"):
            return int(line.split("|")[1])
    raise SystemExit("skip_plugin_verl.startup is not imported at start-up: is skip-plugin-verl installed here?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {name: {"import": [], "init": []} for name in VARIANTS}
    hook = []
    with tempfile.TemporaryDirectory(prefix="bench-verl-bridge-") as dump_dir:
        for _ in range(args.repeat):
            for name in random.sample(list(VARIANTS), len(VARIANTS)):
                said = child(VARIANTS[name], dump_dir)
                assert (said["served_by"] is not None) == (name == "bridge on"), said
                for key in ("import", "init"):
                    times[name][key].append(said[key])
            hook.append(startup_hook_us())
    on, off = (times[name] for name in VARIANTS)
    print(f"{args.repeat} rounds, medians; python {sys.version.split()[0]}")
    print(f"{'':32} {'bridge on':>10} {'bridge off':>10} {'on/off':>7}")
    for key, label in (("import", "import verl.utils.skip (ms)"), ("init", "SkipManager.init (ms)")):
        a, b = statistics.median(on[key]) * 1e3, statistics.median(off[key]) * 1e3
        print(f"{label:32} {a:10.1f} {b:10.1f} {a / b:7.2f}")
    print(f"{'start-up hook, every process (ms)':32} {statistics.median(hook) / 1e3:10.2f}")


if __name__ == "__main__":
    main()
