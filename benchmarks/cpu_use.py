"""Which process of a `skip run` uses the CPUs while it trains: measured, for the schedule benchmarks.

`run` starts the command and samples its process tree (the driver, and Ray's processes and
workers, which the local Ray starts beneath it) and the machine's busy time every
``INTERVAL_S``. The window is from the end of step 1 (model loading, Ray start-up and the first
step's warm-up left out) to the last step's metrics row, the steps the benchmark's step times
cover. A Ray worker is named by its process title (``ray::RolloutWorker...``, ``ray::Policy...``);
a process a worker started (vLLM's engine core) counts as its worker; everything else under the
driver (raylet, GCS, idle workers) counts as ``ray``.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil

INTERVAL_S = 0.25
ROLES = {"ray::RolloutWorker": "rollout", "ray::Policy": "actor"}


class CpuUse:
    def __init__(self, metrics: Path) -> None:
        self.metrics = metrics
        self._roles: dict[int, str] = {}
        self._seconds: dict[int, float] = {}  # CPU seconds per process, its last sample (it may have exited)

    def run(self, command: list[str], log: Path) -> dict[str, float]:
        """Run ``command`` (output to ``log``) and return the cores each role used over the window:
        ``rollout``, ``actor``, ``driver``, ``ray``, and ``machine`` (everything, this sampler included)."""
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            root = psutil.Process(process.pid)
            first = last = None
            rows = 0
            try:
                while process.poll() is None:
                    time.sleep(INTERVAL_S)
                    snapshot = self._sample(root)
                    now_rows = self._step_rows()
                    if now_rows > rows:  # a step ended between the last sample and this one
                        rows = now_rows
                        first = first or snapshot
                        last = snapshot
            finally:  # interrupted: a run (or its Ray processes) left behind would load the next one
                if process.poll() is None:
                    _kill_tree(root)
                    process.wait()
        if process.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-20:])
            raise RuntimeError(f"{' '.join(command[:2])} failed ({process.returncode}); see {log}:\n{tail}")
        if first is None or last is first:
            return {}
        seconds = last["time"] - first["time"]
        return {role: (last[role] - first[role]) / seconds for role in first if role != "time"}

    def _sample(self, root: psutil.Process) -> dict[str, float]:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for process in tree:
            try:
                with process.oneshot():
                    if self._roles.get(process.pid, "ray") == "ray":  # a Ray worker takes its title late
                        parent = self._roles.get(process.ppid(), "ray")  # an engine's own processes (vLLM's core)
                        role = parent if parent in ("rollout", "actor") else _role(process.cmdline())
                        self._roles[process.pid] = "driver" if process is root else role
                    times = process.cpu_times()
                    self._seconds[process.pid] = times.user + times.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        totals = {"rollout": 0.0, "actor": 0.0, "driver": 0.0, "ray": 0.0}
        for pid, used in self._seconds.items():
            totals[self._roles[pid]] += used
        machine = psutil.cpu_times()
        totals["machine"] = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
        return {**totals, "time": time.perf_counter()}

    def _step_rows(self) -> int:
        """Metrics rows of trained steps so far (step 0 is validation before training)."""
        try:
            lines = self.metrics.read_text().splitlines()
        except FileNotFoundError:
            return 0
        return sum(1 for line in lines if line.endswith("}") and json.loads(line)["step"] > 0)


def _role(cmdline: list[str]) -> str:
    title = " ".join(cmdline)
    return next((role for prefix, role in ROLES.items() if title.startswith(prefix)), "ray")


def _kill_tree(root: psutil.Process) -> None:
    try:
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
