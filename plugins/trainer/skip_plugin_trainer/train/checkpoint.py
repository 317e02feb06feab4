"""Training checkpoints that let a killed run resume exactly: model, optimizer, trainer and RNG state.

Each ``global_step_{step}`` directory is built beside its final place (``.tmp-*``: the trained
models' ranks write their shards there too, so on a cluster it must be a filesystem every node
sees, as verl's checkpoints need), every file is fsynced, ``manifest.json`` (sizes and xxh3-128
hashes) is written last and the directory renamed into place, so a checkpoint is complete or
absent and damage is caught on read. Nothing is unpickled: tensors go to safetensors,
everything else to tagged JSON (``skip_core.encoding``).

A checkpoint directory may come from someone else: every file is read as hostile
(``skip_core.reading``: regular files only, sizes and JSON nesting bounded), and whatever does
not verify is a ``CorruptCheckpoint``, never another exception. Pruning counts only checkpoints
that verify, so a damaged newest one never costs the good one before it, and a save over a step
whose checkpoint does not verify moves that one aside first: damage is kept for a look, never deleted.

Temporary and trash names carry ``<pid>@<host>`` (``files.owned``): a save removes those whose
process is gone, never one a live process still writes. Files below the root are written through
``skip_core.writing``, which never follows a link planted at their name.
"""

from __future__ import annotations

import operator
import os
import random
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from skip_core import files, writing

from skip_plugin_trainer.train.checkpoint_files import MANIFEST, Checkpoint, CorruptCheckpoint, read, verify, write

LATEST = "latest_checkpointed_iteration.txt"  # verl's name, so verl tooling finds the step
# At most 18 digits: any step fits an int64, and a name of thousands of digits is no checkpoint.
STEP_DIR = re.compile(r"global_step_(0|[1-9][0-9]{0,17})")
MAX_STEP = 10**18 - 1
# Only this module's own temp and trash names (``writing``'s for the pointer file): ``root`` is
# often a run directory other writers share.
LEFTOVER_PREFIXES = (".tmp-global_step_", ".trash-global_step_", f".{LATEST}.")


class CheckpointWarning(UserWarning):
    """A checkpoint that does not verify was skipped (``latest``) or moved aside (pruning)."""


# Verdicts of this process on checkpoint directories, by path: the manifest's identity when it was
# verified (a directory replaced since has another) and the reason it failed, ``None`` if it passed.
# Verifying hashes every file, minutes for a large model: each checkpoint is verified at most once
# per process, however many managers and prunes look at it.
_verdicts: dict[Path, tuple[tuple[int, ...], str | None]] = {}


class CheckpointManager:
    """The checkpoints under ``root``, one ``global_step_{step}`` directory each.

    Assumes one writer per ``root`` (rank 0; ``skip run`` holds its run directory's lock): two
    saving the same step would replace each other's. ``save`` removes only the leftovers of
    saves and prunes whose process is gone.
    """

    def __init__(self, root: str | os.PathLike, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 or None, not {keep!r}")
        self.root = Path(root).expanduser().absolute()
        self.keep = keep
        self._pinned: set[Path] = set()
        # Each with its identity: a checkpoint published at that path since is another one.
        self._rejected: set[tuple[Path, tuple[int, ...] | None]] = set()

    def pin(self, path: str | os.PathLike) -> None:
        """Never prune ``path``: the checkpoint a run resumed from stays its fallback for the whole run,
        whatever becomes of the checkpoints the run writes."""
        self._pinned.add(Path(os.path.realpath(path)))

    def path(self, step: int) -> Path:
        return self.root / f"global_step_{_check_step(step)}"

    def save(
        self,
        step: int,
        trainer: Mapping[str, Any],
        rng: Mapping[str, Any],
        shards: Callable[[Path], Mapping[str, Any]],
    ) -> Path:
        """Write the checkpoint of ``step``, replacing any previous one atomically; prune beyond
        ``keep``. ``shards(directory)``: the trained models' ranks write theirs (``checkpoint_files.write``)."""
        step = _check_step(step)
        final = self.path(step)
        self.root.mkdir(parents=True, exist_ok=True)
        files.remove_abandoned(self.root, LEFTOVER_PREFIXES)
        tmp = Path(tempfile.mkdtemp(prefix=files.owned(f".tmp-{final.name}-"), dir=self.root))
        try:
            write(tmp, step, trainer, rng, shards)
            # publish deletes what it replaces: damage goes aside instead (a rename that fails here
            # fails publish's own rename too, so nothing is deleted then either).
            if os.path.lexists(final) and (reason := self._verdict(step)) is not None:
                self._set_aside(final, reason)
            files.publish(tmp, final)
            files.fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _remember(final, None)  # written and sealed here: no need to hash it again to trust it
        self._write_latest(step)
        self._prune(keep_step=step)
        return final

    def steps(self) -> list[int]:
        """Steps of complete checkpoints (manifest present; not yet verified), ascending."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        matches = (STEP_DIR.fullmatch(name) for name in names)
        return sorted(int(m[1]) for m in matches if m and (self.root / m[0] / MANIFEST).is_file())

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; broken ones are skipped with a warning (once: those
        rejected before are passed over in silence)."""
        for step in reversed(self.steps()):
            path = self.path(step)
            if (path, _identity(path)) in self._rejected:
                continue
            try:
                return self.load(step)
            except CorruptCheckpoint as exc:
                self.reject(exc)
        return None

    def newest_intact(self) -> Path | None:
        """The newest checkpoint that verifies, without loading it: the one a run resumes from.
        Those this process wrote or verified are not hashed again."""
        for step in reversed(self.steps()):
            if self._verdict(step) is None:
                return self.path(step)
        return None

    def load(self, step: int) -> Checkpoint:
        """The checkpoint of ``step``, verified against its manifest; ``CorruptCheckpoint`` otherwise."""
        step = _check_step(step)
        path = self.path(step)
        identity = _identity(path)
        try:
            _check_inside(path, self.root)
            sizes = verify(path, step)
            try:
                checkpoint = read(path, step, sizes)
            except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
                raise CorruptCheckpoint(path, f"cannot decode: {exc}") from exc
        except CorruptCheckpoint as exc:
            _remember(path, exc.reason, identity)
            raise
        _remember(path, None, identity)
        return checkpoint

    def reject(self, corrupt: CorruptCheckpoint) -> None:
        """Pass over the checkpoint ``corrupt`` names, with a warning: from now on it is one that does
        not verify (``latest`` skips it, a save or a prune moves it aside), also where a rank, not
        its hashes, found it out."""
        identity = _identity(corrupt.path)
        self._rejected.add((corrupt.path, identity))
        _remember(corrupt.path, corrupt.reason, identity)
        warnings.warn(f"skip: ignoring checkpoint {corrupt.path}: {corrupt.reason}", CheckpointWarning, stacklevel=3)

    def _write_latest(self, step: int) -> None:
        """verl's pointer file, replaced atomically so a reader never sees it empty; a link planted
        at its name is refused (``writing.UnsafeDestination``), never written through."""
        writing.write_bytes(self.root, LATEST, str(step).encode())

    def _prune(self, keep_step: int) -> None:
        """Keep the ``keep`` newest checkpoints that verify, the one just written and the pinned ones;
        delete the older ones. One that does not verify is moved aside first, neither kept nor counted:
        counting it would delete the last good checkpoint and keep the broken one."""
        if self.keep is None:
            return
        kept = 0
        for step in reversed(self.steps()):
            path = self.path(step)
            if kept < self.keep:
                reason = self._verdict(step)
                if reason is None:
                    kept += 1
                else:
                    self._set_aside(path, reason)
            elif step != keep_step and Path(os.path.realpath(path)) not in self._pinned:
                self._remove(path)

    def _verdict(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` does not verify, or ``None``; from memory when this process
        verified this very directory before."""
        path = self.path(step)
        identity = _identity(path)
        known = _verdicts.get(path)
        if identity is not None and known is not None and known[0] == identity:
            return known[1]
        try:
            _check_inside(path, self.root)
            verify(path, step)
        except CorruptCheckpoint as exc:
            _remember(path, exc.reason, identity)
            return exc.reason
        _remember(path, None, identity)
        return None

    def _set_aside(self, path: Path, reason: str) -> None:
        """Rename a checkpoint that does not verify to a name no step matches (kept for a look, never loaded)."""
        aside, n = path.with_name(f"{path.name}.corrupt"), 1
        while os.path.lexists(aside):
            n += 1
            aside = path.with_name(f"{path.name}.corrupt-{n}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        except OSError as exc:
            warnings.warn(
                f"skip: checkpoint {path} does not verify ({reason}) and cannot be moved aside ({exc}); "
                "it is not counted among the checkpoints kept",
                CheckpointWarning,
                stacklevel=4,
            )
            return
        _verdicts.pop(path, None)
        files.fsync_dir(self.root)
        warnings.warn(
            f"skip: checkpoint {path} does not verify ({reason}); moved it aside to {aside}, where nothing loads it",
            CheckpointWarning,
            stacklevel=4,
        )

    def _remove(self, path: Path) -> None:
        """Rename first, so a kill mid-delete leaves a leftover, not a half-deleted checkpoint."""
        trash = self.root / f"{files.owned(f'.trash-{path.name}-')}{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        files.delete_tree(trash)


def _check_step(step: int) -> int:
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"checkpoint step must not be negative, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"checkpoint step must have at most 18 digits, got {step}")
    return step


def _identity(path: Path) -> tuple[int, ...] | None:
    """What tells this checkpoint directory from one published in its place since: its manifest's inode."""
    try:
        info = os.lstat(path / MANIFEST)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)


def _remember(path: Path, reason: str | None, identity: tuple[int, ...] | None = None) -> None:
    identity = identity or _identity(path)
    if identity is not None:
        _verdicts[path] = (identity, reason)


def _check_inside(path: Path, root: Path) -> None:
    """A ``global_step_*`` link to a directory elsewhere is not this root's checkpoint."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise CorruptCheckpoint(path, "resolves outside the checkpoint root")


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step draws from, so a resumed run draws the same numbers."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (lists where tuples were are accepted)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(tuple(numpy_state) if isinstance(numpy_state, list) else numpy_state)
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"skip: restoring CUDA RNG of {len(cuda)} devices on {torch.cuda.device_count()}",
                CheckpointWarning,
                stacklevel=2,
            )
        for device, device_state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
