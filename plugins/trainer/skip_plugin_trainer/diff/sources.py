"""What ``skip diff`` compares, read from disk: a run directory (``metrics.jsonl`` and
``train_data/``, see ``skip_plugin_trainer.train.train_data``) or a skip cache (``skip_core.store``).

Both are read as hostile: every file through ``skip_core.reading`` or the store's own verifying
read, and anything wrong is a ``DiffError`` naming the path, which the command prints as one line.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from skip_core import reading
from skip_core.config import Namespace
from skip_core.encoding import TENSORS
from skip_core.entries import GENERATION, STEP_NAME, CorruptEntry, scan, verify
from skip_core.errors import SkipError
from skip_core.store import CacheStore, Entry

METRICS = "metrics.jsonl"
#: The cache roles whose results ``skip diff`` compares, in the order a step computes them.
ROLES = ("rollout", "reward", "old_log_prob", "ref_log_prob", "values")


class DiffError(SkipError, ValueError):
    """A path that cannot be compared; the message names it and says why."""


class Run:
    """A run directory: the metrics of each step, and the training data of the steps that wrote it."""

    def __init__(self, path: Path) -> None:
        from skip_plugin_trainer.train.train_data import train_data_steps

        self.path = path
        self.notes: list[str] = []
        self.metrics = read_metrics(path / METRICS, path, self.notes) if os.path.lexists(path / METRICS) else {}
        self._tensor_steps = set(train_data_steps(path))

    def steps(self) -> set[int]:
        return self._tensor_steps | set(self.metrics)

    def tensors(self, step: int) -> dict[str, Any]:
        from skip_plugin_trainer.train.train_data import read_train_data

        return read_train_data(self._file(step), root=self.path) if step in self._tensor_steps else {}

    def sizes(self, step: int) -> dict[Path, int]:
        """The bytes of the file ``tensors(step)`` loads (a sparse file's too: it loads as zeros)."""
        return _sizes([self._file(step)] if step in self._tensor_steps else [])

    def _file(self, step: int) -> Path:
        from skip_plugin_trainer.train.train_data import DIRECTORY

        return self.path / DIRECTORY / f"step_{step}.safetensors"


class Cache:
    """The step directories of one run's roles under a dump_dir, a run's directory in one, or a
    ``GBS...`` directory; a step's tensors are those of every role's entry, each verified as it loads."""

    def __init__(self, path: Path, found: list[Path]) -> None:
        self.path = path
        self.notes: list[str] = []
        self.metrics: dict[int, dict[str, float]] = {}
        namespaces: dict[Path, list[int]] = {}
        for step_dir in found:
            if GENERATION.fullmatch(step_dir.parent.name):  # DAPO's extra generations: the first one is compared
                continue
            namespaces.setdefault(step_dir.parent, []).append(int(step_dir.name))
        by_role: dict[str, list[tuple[Path, list[int]]]] = {}
        for directory, steps in namespaces.items():
            role = self._role(directory, steps)
            if role in ROLES:
                by_role.setdefault(role, []).append((directory, steps))
            else:
                self.notes.append(f"{directory}: role {role} is not compared")
        runs = {d.parent if role == "rollout" else d.parent.parent for role, dirs in by_role.items() for d, _ in dirs}
        if len(runs) > 1 or any(len(dirs) > 1 for dirs in by_role.values()):
            self._several([directory for dirs in by_role.values() for directory, _ in dirs])
        self.roles = {role: (by_role[role][0][0], set(by_role[role][0][1])) for role in ROLES if role in by_role}

    def steps(self) -> set[int]:
        return set().union(*(steps for _, steps in self.roles.values()))

    def tensors(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for role, (directory, steps) in self.roles.items():
            if step in steps:
                for key, tensor in self._load(role, directory / str(step)).batch.items():
                    out.setdefault(key, tensor)
        return out

    def sizes(self, step: int) -> dict[Path, int]:
        """The bytes of the tensor files ``tensors(step)`` loads."""
        return _sizes([d / str(step) / TENSORS for d, steps in self.roles.values() if step in steps])

    def _role(self, directory: Path, steps: list[int]) -> str:
        """The role its entries record, from the first whose sizes check out (hashes are checked on load)."""
        problem = None
        for step in sorted(steps):
            try:
                role = verify(directory / str(step), deep=False, root=self.path).get("role")
            except CorruptEntry as exc:
                problem = problem or exc
                continue
            if isinstance(role, str):
                return role
            problem = problem or CorruptEntry(f"meta.json records role {role!r}", directory / str(step))
        raise DiffError(f"{problem.path}: {problem}")

    def _load(self, role: str, step_dir: Path) -> Any:
        try:
            meta = verify(step_dir, role=role, root=self.path)
            # ``load`` reads below the store's root only; the namespace names directories it does not use here.
            return CacheStore(self.path, Namespace(), role).load(Entry(int(step_dir.name), step_dir, meta))
        except (CorruptEntry, SafetensorError) as exc:
            raise DiffError(f"{step_dir}: {exc}") from None

    def _several(self, directories: list[Path]) -> None:
        names = ", ".join(str(d.relative_to(self.path)) for d in directories[:3])
        names += f" and {len(directories) - 3} more" if len(directories) > 3 else ""
        raise DiffError(f"{self.path}: holds the caches of several runs ({names}); give the directory of one")


def _sizes(paths: list[Path]) -> dict[Path, int]:
    """Each file's size, as ``lstat`` says (a link's own: it is refused when read)."""
    sizes = {}
    for path in paths:
        with contextlib.suppress(OSError):  # what cannot be read is named when it is
            sizes[path] = os.lstat(path).st_size
    return sizes


def memory_budget() -> int | None:
    """The bytes a comparison may load at once: half the memory Linux says is available, or
    ``None`` where it cannot say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_source(path: Path) -> Run | Cache:
    """The run or the cache at ``path``; ``DiffError`` naming it when it is neither."""
    path = Path(path).expanduser().absolute()
    if not path.is_dir():
        raise DiffError(f"{path}: no such directory")
    if os.path.lexists(path / METRICS) or os.path.lexists(path / "train_data"):
        return Run(path)
    found = [step_dir for step_dir in scan(path) if STEP_NAME.fullmatch(step_dir.name)]
    if not found:
        raise DiffError(
            f"{path}: neither a run directory (metrics.jsonl, train_data/) nor a skip cache (GBS*/<step>/ below it)"
        )
    return Cache(path, found)


def read_metrics(path: Path, root: Path, notes: list[str]) -> dict[int, dict[str, float]]:
    """The numeric metrics of each step of a ``metrics.jsonl``; a step's later lines add to and
    override its earlier ones (a staged line, then the logged one). Lines that do not parse (a
    crash mid-write) are skipped, and ``notes`` says how many."""
    from skip_plugin_trainer.train.tracking import MAX_METRICS_BYTES

    try:
        text = reading.read_bytes(path, MAX_METRICS_BYTES, root).decode("utf-8", errors="replace")
    except (OSError, ValueError) as exc:
        raise DiffError(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None
    metrics: dict[int, dict[str, float]] = {}
    skipped = 0
    for line in filter(str.strip, text.splitlines()):
        try:
            record = reading.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            skipped += 1
            continue
        values = metrics.setdefault(step, {})
        for key, value in record.items():
            if key != "step" and type(value) in (int, float):  # not bool, which is an int too
                with contextlib.suppress(OverflowError):  # an integer past any float: no metric
                    values[key] = float(value)
    if skipped:
        notes.append(f"{path}: {skipped} line{'s' * (skipped > 1)} without a step's metrics skipped")
    return metrics
