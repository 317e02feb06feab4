"""One checkpoint's files: how ``global_step_{step}`` is written, verified and read.

Format 2: ``actor/`` and ``critic/`` hold each trained model's weights and optimizer state as
its ranks wrote them (``shards.py``: safetensors, one file per rank); ``state.json`` (tagged
JSON: the trainer's state, the RNG states, each model's optimizer hyper-parameters) and
``state.safetensors`` (the tensors among them), all fsynced, then ``manifest.json`` (every
file's size and xxh3-128 hash) last. A directory holding a file the manifest does not list does
not verify: the shards' reader would read it. Format 1 (one process's ``model.safetensors`` and
``optimizer.safetensors``) is still read. A checkpoint directory may come from someone else: every file
is read as hostile (``skip_core.reading``: regular files only, inside the checkpoint, sizes and
JSON nesting bounded, hashed through the descriptor that was checked), and whatever does not
verify is a ``CorruptCheckpoint``, never another exception. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from skip_core import encoding, entries, files, reading

FORMAT = "skip-checkpoint"
VERSION = 2
MODEL = "model.safetensors"  # format 1
OPTIMIZER = "optimizer.safetensors"  # format 1
STATE = "state.json"
TENSORS = "state.safetensors"
MANIFEST = "manifest.json"
DATA_FILES = {1: {MODEL, OPTIMIZER, STATE}, 2: {STATE, TENSORS}}
GROUPS = ("actor", "critic")  # the trained models, each a directory of its ranks' files
_SHARD_FILE = re.compile(r"(actor|critic)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")
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
    """One verified checkpoint, in the shapes the trainer saved. ``shards``: what each trained
    model's ranks need to read their state from ``path / name`` (format 2); ``model`` and
    ``optimizer``: the policy's whole state (format 1)."""

    step: int
    trainer: dict[str, Any]
    rng: dict[str, Any]
    path: Path
    shards: dict[str, dict[str, Any]] | None = None
    model: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None


def write(
    directory: Path,
    step: int,
    trainer: Mapping[str, Any],
    rng: Mapping[str, Any],
    shards: Callable[[Path], Mapping[str, Any]],
) -> None:
    """All files of one checkpoint, fsynced. ``shards(directory)`` has the trained models' ranks
    write their files into ``directory / <model>`` and returns what each needs to read them
    back; the trainer's and RNG state are encoded first, so unstorable state fails before it."""
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "trainer": encoding.encode(_split(trainer, "trainer", tensors), "trainer"),
        "rng": encoding.encode(_split(rng, "rng", tensors), "rng"),
    }
    saved = shards(directory)
    for name in saved:
        files.fsync_dir(directory / name)
    state["shards"] = encoding.encode(dict(saved), "shards")
    files.write_synced(directory / STATE, json.dumps(state).encode())
    _save_tensors(encoding.storable(tensors), directory / TENSORS)
    listed = sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file())
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": {name: entries.seal(directory / name) for name in listed},
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


def _shards(value: Any) -> dict[str, dict[str, Any]]:
    """What each trained model's ranks read their state with: ``{model: {"param_groups": list | None}}``."""
    if not isinstance(value, dict) or not set(value) <= set(GROUPS) or "actor" not in value:
        raise ValueError(f"{STATE} records shards of {sorted(value) if isinstance(value, dict) else value!r}")
    for name, saved in value.items():
        groups = saved.get("param_groups", ()) if isinstance(saved, dict) else ()
        if not (groups is None or (isinstance(groups, list) and all(isinstance(g, dict) for g in groups))):
            raise ValueError(f"{STATE} records no param groups of {name}'s optimizer")
    return value


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
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or version not in DATA_FILES:
        raise CorruptCheckpoint(path, f"unsupported format {manifest.get('format')!r} {version!r}")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(path, f"manifest records step {manifest.get('step')!r}")
    files = manifest.get("files")
    required = DATA_FILES[version]
    if not isinstance(files, dict) or not _listable(files, required, version):
        raise CorruptCheckpoint(path, f"manifest lists files {sorted(files) if isinstance(files, dict) else files!r}")
    if version > 1:
        unlisted = _unlisted(path, set(files))
        if unlisted:
            raise CorruptCheckpoint(path, f"holds {unlisted}, which its manifest does not list")
    return {name: _check_file(path, name, expected) for name, expected in files.items()}


def _listable(files: dict, required: set[str], version: int) -> bool:
    """The files of a checkpoint of ``version``: exactly ``required`` (format 1), or those and the
    models' shard files (format 2)."""
    if version == 1:
        return set(files) == required
    return required <= set(files) and all(name in required or _SHARD_FILE.fullmatch(name) for name in files)


def _unlisted(path: Path, listed: set[str]) -> str | None:
    """An entry of the checkpoint that is neither the manifest nor a file it lists (one is enough)."""
    for entry in sorted(path.rglob("*")):
        name = entry.relative_to(path).as_posix()
        if name not in listed and name != MANIFEST and not (name in GROUPS and entry.is_dir()):
            return name
    return None


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
            if entries.fd_digest(fd) != expected.get("xxh3_128"):
                raise CorruptCheckpoint(path, f"{name} does not match its recorded hash")
    except reading.UnsafeFile as exc:
        raise CorruptCheckpoint(path, str(exc)) from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"cannot read {name}: {exc}") from None
    return size


def read(path: Path, step: int, sizes: Mapping[str, int]) -> Checkpoint:
    state = reading.read_json(path / STATE, sizes[STATE], root=path)
    if TENSORS in sizes:
        tensors = load_file(str(path / TENSORS))
        return Checkpoint(
            step=step,
            trainer=_attach(encoding.decode(state["trainer"]), tensors),
            rng=_attach(encoding.decode(state["rng"]), tensors),
            path=path,
            shards=_shards(encoding.decode(state["shards"])),
        )
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
