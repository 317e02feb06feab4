"""Training checkpoints that let a killed run resume exactly: model, optimizer, trainer and RNG state.

Each ``global_step_{step}`` directory is built beside its final place (``.tmp-*``), every file is
fsynced, ``manifest.json`` (sizes and xxh3-128 hashes) is written last and the directory renamed
into place, so a checkpoint is complete or absent and damage is caught on read. Nothing is
unpickled: tensors go to safetensors, everything else to tagged JSON (``skip_core.encoding``).
"""

from __future__ import annotations

import json
import operator
import os
import random
import re
import shutil
import stat
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from skip_core import encoding, files, store

FORMAT = "skip-checkpoint"
VERSION = 1
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
DATA_FILES = (MODEL, OPTIMIZER, STATE)
LATEST = "latest_checkpointed_iteration.txt"  # verl's name, so verl tooling finds the step
STEP_DIR = re.compile(r"global_step_(0|[1-9][0-9]*)")
MAX_MANIFEST_BYTES = 1 << 20
# Only this module's own temp and trash names: ``root`` is often a run directory other writers share.
LEFTOVER_PREFIXES = (".tmp-global_step_", ".trash-global_step_", f".tmp-{LATEST}-")
_TENSOR = "__skip_tensor__"  # JSON stand-in for a tensor stored in optimizer.safetensors


class CorruptCheckpoint(RuntimeError):
    """A checkpoint directory that does not verify; loading it could resume from wrong state."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class CheckpointWarning(UserWarning):
    """``latest()`` skipped a checkpoint that does not verify and fell back to an older one."""


@dataclass
class Checkpoint:
    """One verified checkpoint, in the shapes the trainer saved."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]
    rng: dict[str, Any]
    path: Path


class CheckpointManager:
    """The checkpoints under ``root``, one ``global_step_{step}`` directory each.

    Assumes one writer per ``root`` (rank 0): ``save`` deletes the temp and trash leftovers of
    earlier saves, which another process saving at the same moment would still be using.
    """

    def __init__(self, root: str | os.PathLike, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 or None, not {keep!r}")
        self.root = Path(root).expanduser().absolute()
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"global_step_{_check_step(step)}"

    def save(
        self,
        step: int,
        model: Mapping[str, torch.Tensor],
        optimizer: Mapping[str, Any],
        trainer: Mapping[str, Any],
        rng: Mapping[str, Any],
    ) -> Path:
        """Write the checkpoint of ``step``, replacing any previous one atomically; prune beyond ``keep``."""
        step = _check_step(step)
        final = self.path(step)
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=self.root))
        try:
            _write(tmp, step, model, optimizer, trainer, rng)
            files.publish(tmp, final)
            files.fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_latest(step)
        self._prune(keep_step=step)
        return final

    def steps(self) -> list[int]:
        """Steps of complete checkpoints (manifest present; not yet verified), ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        matches = (STEP_DIR.fullmatch(name) for name in names)
        return sorted(int(m[1]) for m in matches if m and (self.root / m[0] / MANIFEST).is_file())

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; broken ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                return self.load(step)
            except CorruptCheckpoint as exc:
                warnings.warn(f"skip: ignoring checkpoint {exc.path}: {exc.reason}", CheckpointWarning, stacklevel=2)
        return None

    def load(self, step: int) -> Checkpoint:
        """The checkpoint of ``step``, verified against its manifest; ``CorruptCheckpoint`` otherwise."""
        step = _check_step(step)
        path = self.path(step)
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise CorruptCheckpoint(path, "resolves outside the checkpoint root")
        _verify(path, step)
        try:
            return _read(path, step)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            raise CorruptCheckpoint(path, f"cannot decode: {exc}") from exc

    def _write_latest(self, step: int) -> None:
        """verl's pointer file, replaced atomically so a reader never sees it empty."""
        tmp = self.root / f".tmp-{LATEST}-{uuid.uuid4().hex[:12]}"
        try:
            files.write_synced(tmp, str(step).encode())
            os.replace(tmp, self.root / LATEST)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        files.fsync_dir(self.root)

    def _prune(self, keep_step: int) -> None:
        """Delete all but the ``keep`` newest checkpoints, never the one just written."""
        if self.keep is None:
            return
        for step in self.steps()[: -self.keep]:
            if step != keep_step:
                self._remove(self.path(step))

    def _remove(self, path: Path) -> None:
        """Rename first, so a kill mid-delete leaves a leftover, not a half-deleted checkpoint."""
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        _delete(trash)

    def _remove_leftovers(self) -> None:
        """Temp and trash entries of saves or prunes that were killed."""
        for name in os.listdir(self.root):
            if name.startswith(LEFTOVER_PREFIXES):
                _delete(self.root / name)


def _check_step(step: int) -> int:
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"checkpoint step must not be negative, got {step}")
    return step


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _write(
    directory: Path,
    step: int,
    model: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    trainer: Mapping[str, Any],
    rng: Mapping[str, Any],
) -> None:
    """All files of one checkpoint, fsynced; JSON first so unstorable state fails before big writes."""
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "model_keys": list(model),
        "optimizer": encoding.encode(_split(optimizer, "", tensors), "optimizer"),
        "trainer": encoding.encode(_split(trainer, "trainer", tensors), "trainer"),
        "rng": encoding.encode(_split(rng, "rng", tensors), "rng"),
    }
    files.write_synced(directory / STATE, json.dumps(state).encode())
    save_file(encoding.storable(model), str(directory / MODEL), metadata={"format": "pt"})
    save_file(encoding.storable(tensors), str(directory / OPTIMIZER), metadata={"format": "pt"})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": {name: store.seal(directory / name) for name in DATA_FILES},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    files.write_synced(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    files.fsync_dir(directory)


def _split(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with each tensor moved into ``tensors`` (for safetensors) and a reference left for JSON."""
    if isinstance(value, torch.Tensor):
        name = key or "tensor"
        while name in tensors:
            name += "_"
        tensors[name] = value
        return {_TENSOR: name}
    if isinstance(value, Mapping):
        if _TENSOR in value:
            raise encoding.EncodingError(f"{key}: the key {_TENSOR!r} is reserved")
        return {k: _split(v, f"{key}.{k}" if key else str(k), tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_split(v, f"{key}.{i}" if key else str(i), tensors) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _attach(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``_split``."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        return {k: _attach(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_attach(v, tensors) for v in value)
    return value


def _verify(path: Path, step: int) -> None:
    """Check the manifest and every file's size and hash, so a torn or flipped byte is never loaded."""
    manifest = _read_manifest(path)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CorruptCheckpoint(path, f"unsupported format {manifest.get('format')!r} {manifest.get('version')!r}")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(path, f"manifest records step {manifest.get('step')!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(DATA_FILES):
        raise CorruptCheckpoint(path, f"manifest lists files {sorted(files) if isinstance(files, dict) else files!r}")
    for name, expected in files.items():
        _check_file(path, name, expected)


def _read_manifest(path: Path) -> dict:
    try:
        with open(path / MANIFEST, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, f"incomplete: {MANIFEST} is missing") from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read {MANIFEST}: {exc}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpoint(path, f"{MANIFEST} is too large")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpoint(path, f"{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(path, f"{MANIFEST} is not an object")
    return manifest


def _check_file(path: Path, name: str, expected: Any) -> None:
    file = path / name
    if not isinstance(expected, dict):
        raise CorruptCheckpoint(path, f"manifest entry for {name} is malformed")
    try:
        info = file.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpoint(path, f"{name} is not a regular file")
        if info.st_size != expected.get("bytes"):
            raise CorruptCheckpoint(path, f"{name} has {info.st_size} bytes, manifest records {expected.get('bytes')}")
        if store.file_digest(file) != expected.get("xxh3_128"):
            raise CorruptCheckpoint(path, f"{name} does not match its recorded hash")
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read {name}: {exc}") from None


def _read(path: Path, step: int) -> Checkpoint:
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    model = load_file(str(path / MODEL))
    keys = state["model_keys"]
    if sorted(keys) != sorted(model):
        raise ValueError(f"{MODEL} holds other tensors than {STATE} lists")
    tensors = load_file(str(path / OPTIMIZER))
    return Checkpoint(
        step=step,
        model={key: model[key] for key in keys},
        optimizer=_attach(encoding.decode(state["optimizer"]), tensors),
        trainer=_attach(encoding.decode(state["trainer"]), tensors),
        rng=_attach(encoding.decode(state["rng"]), tensors),
        path=path,
    )


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
