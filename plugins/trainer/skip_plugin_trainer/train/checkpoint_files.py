"""One checkpoint's files: how ``global_step_{step}`` is written, verified and read.

``state.json`` (tagged JSON: the trainer's state, the optimizer's non-tensor state, the RNG
states), ``model.safetensors`` and ``optimizer.safetensors``, all fsynced, then ``manifest.json``
(sizes and xxh3-128 hashes) last. A checkpoint directory may come from someone else: every file
is read as hostile (``skip_core.reading``: regular files only, inside the checkpoint, sizes and
JSON nesting bounded, hashed through the descriptor that was checked), and whatever does not
verify is a ``CorruptCheckpoint``, never another exception. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from skip_core import encoding, files, reading, store

FORMAT = "skip-checkpoint"
VERSION = 1
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
DATA_FILES = (MODEL, OPTIMIZER, STATE)
MAX_MANIFEST_BYTES = 1 << 20
_TENSOR = "__skip_tensor__"  # JSON stand-in for a tensor stored in optimizer.safetensors
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports an I/O error's errno


class CorruptCheckpoint(RuntimeError):
    """A checkpoint directory that does not verify; loading it could resume from wrong state."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


@dataclass
class Checkpoint:
    """One verified checkpoint, in the shapes the trainer saved."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]
    rng: dict[str, Any]
    path: Path


def write(
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
    _save_tensors(encoding.storable(model), directory / MODEL)
    _save_tensors(encoding.storable(tensors), directory / OPTIMIZER)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": {name: store.seal(directory / name) for name in DATA_FILES},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    files.write_synced(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    files.fsync_dir(directory)


def _save_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """``save_file``, whose I/O failures come back as the ``OSError`` they are: safetensors reports
    them as text, and a full disk must read as a full disk, naming the file."""
    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except SafetensorError as exc:
        code = _OS_ERROR.search(str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(file)) from exc


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


def verify(path: Path, step: int) -> dict[str, int]:
    """Check the manifest and every file's size and hash, so a torn or flipped byte is never loaded;
    the sizes it records, by file."""
    manifest = _read_manifest(path)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CorruptCheckpoint(path, f"unsupported format {manifest.get('format')!r} {manifest.get('version')!r}")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(path, f"manifest records step {manifest.get('step')!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(DATA_FILES):
        raise CorruptCheckpoint(path, f"manifest lists files {sorted(files) if isinstance(files, dict) else files!r}")
    return {name: _check_file(path, name, expected) for name, expected in files.items()}


def _read_manifest(path: Path) -> dict:
    try:
        manifest = reading.read_json(path / MANIFEST, MAX_MANIFEST_BYTES, root=path)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, f"incomplete: {MANIFEST} is missing") from None
    except reading.UnsafeFile as exc:
        raise CorruptCheckpoint(path, str(exc)) from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(path, f"{MANIFEST} is not an object")
    return manifest


def _check_file(path: Path, name: str, expected: Any) -> int:
    """The size of ``name``, once it is the regular file of the size and hash the manifest records."""
    size = expected.get("bytes") if isinstance(expected, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptCheckpoint(path, f"manifest entry for {name} is malformed")
    file = path / name
    try:
        with reading.opened(file, limit=size, root=path) as fd:
            if os.fstat(fd).st_size != size:
                raise CorruptCheckpoint(path, f"{name} has {os.fstat(fd).st_size} bytes, manifest records {size}")
            if store.fd_digest(fd) != expected.get("xxh3_128"):
                raise CorruptCheckpoint(path, f"{name} does not match its recorded hash")
    except reading.UnsafeFile as exc:
        raise CorruptCheckpoint(path, str(exc)) from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read {name}: {exc}") from None
    return size


def read(path: Path, step: int, sizes: Mapping[str, int]) -> Checkpoint:
    state = reading.read_json(path / STATE, sizes[STATE], root=path)
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
