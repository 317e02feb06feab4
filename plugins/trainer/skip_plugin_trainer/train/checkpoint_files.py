"""One checkpoint's files: how ``global_step_{step}`` is written, verified and read.

Format 2: ``actor/`` and ``critic/`` hold each trained model's weights and optimizer state as
its ranks wrote them (``shards.py``: safetensors, one file per rank); ``state.json`` (tagged
JSON: the trainer's state, the RNG states, each model's optimizer hyper-parameters) and
``state.safetensors`` (the tensors among them), all fsynced, then ``manifest.json`` (every
file's size and xxh3-128 hash, and each shard file's tensors: ``tensors``) last. A directory
holding a file the manifest does not list does not verify: the shards' reader would read it.

A shard whose hash was recorded again over other contents must not reach a rank: its header is
read on every verify (``shards.describe``: the header alone, no tensor data), and one that does
not parse, whose data offsets or sharding record the reader could not use, or that holds other
tensors, dtypes, shapes or offsets than its manifest records is a ``CorruptCheckpoint``. The
record is an optional key of format 2's manifest entries, not a format 3: a format 2 checkpoint
written before it is still read (its headers are still checked, and a rank checks each tensor
against its model), and an older skip still reads the checkpoints written now.

Format 1 (one process's ``model.safetensors`` and ``optimizer.safetensors``) is still read. A
checkpoint directory may come from someone else: every file is read as hostile
(``skip_core.reading``: regular files only, inside the checkpoint, sizes and JSON nesting
bounded, hashed through the descriptor that was checked), and whatever does not verify is a
``CorruptCheckpoint``, never another exception. Nothing is unpickled.
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
from safetensors.torch import load_file, save
from skip_core import encoding, entries, files, reading, writing
from skip_core.progress import progress

from skip_plugin_trainer.train.shards import describe

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
# The shards' records make it grow with tensors x ranks: about 90 bytes a tensor, a 70B model's
# ~2,900 tensors (weights and AdamW's state) in each of 64 ranks' files is ~17 MB.
MAX_MANIFEST_BYTES = 64 << 20
_TENSOR = "__skip_tensor__"  # JSON stand-in for a tensor stored in optimizer.safetensors


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
    writing.write_bytes(directory, STATE, json.dumps(state).encode())
    # Serialized here and written by Python: a full disk reads as the OSError it is, not as safetensors' text.
    writing.write_bytes(directory, TENSORS, save(encoding.storable(tensors), metadata={"format": "pt"}))
    listed = sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file())
    sealed = {}
    # Hashing a 7B model's shards and optimizer state reads tens of GB: shown, in MB read.
    megabytes = sum((directory / name).stat().st_size >> 20 for name in listed)
    with progress(megabytes, "sealing the checkpoint", "MB") as read:
        for name in listed:
            sealed[name] = _sealed(directory, name)
            read(sealed[name]["bytes"] >> 20)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "files": sealed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    writing.write_bytes(directory, MANIFEST, json.dumps(manifest, indent=1).encode())


def _sealed(directory: Path, name: str) -> dict[str, Any]:
    """The manifest's entry of a written file: size and hash, and a shard's tensors."""
    entry = entries.seal(directory / name)
    if _SHARD_FILE.fullmatch(name):
        entry["tensors"] = describe(directory / name)
    return entry


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
    sizes = {name: _check_file(path, name, expected) for name, expected in files.items()}
    for name, expected in files.items():
        if version > 1 and _SHARD_FILE.fullmatch(name):
            _check_shard(path, name, expected)
    return sizes


def _listable(files: dict, required: set[str], version: int) -> bool:
    """The files of a checkpoint of ``version``: exactly ``required`` (format 1), or those and the
    models' shard files (format 2)."""
    if version == 1:
        return set(files) == required
    return required <= set(files) and all(name in required or _SHARD_FILE.fullmatch(name) for name in files)


def _unlisted(path: Path, listed: set[str]) -> str | None:
    """An entry of the checkpoint that is neither the manifest nor a file it lists (one is enough)."""
    for here, dirnames, filenames in reading.walk(path):  # never recursive: a tree may be 1,100 levels deep
        for name in [*dirnames, *filenames]:
            relative = (here / name).relative_to(path).as_posix()
            # A model's directory; one that is a link is refused when its listed files are read.
            if relative not in listed and relative != MANIFEST and relative not in GROUPS:
                return relative
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


def _check_shard(path: Path, name: str, expected: dict) -> None:
    """A shard's header parses, as the ranks' reader will parse it, and holds what the manifest
    records (a manifest written before records were kept records nothing to compare)."""
    recorded = expected.get("tensors")
    if recorded is not None and not isinstance(recorded, dict):
        raise CorruptCheckpoint(path, f"manifest entry for {name} is malformed")
    try:
        found = describe(path / name)
    except (SafetensorError, ValueError, OSError) as exc:
        raise CorruptCheckpoint(path, f"{name}: cannot read its safetensors header: {exc}") from None
    if recorded is None or found == recorded:
        return
    for tensor in sorted(found.keys() | recorded.keys()):
        if tensor not in recorded:
            reason = f"holds {tensor}, which its manifest does not record"
        elif tensor not in found:
            reason = f"lacks {tensor}, which its manifest records"
        elif found[tensor] != recorded[tensor]:
            reason = f"holds {tensor} as {_shown(found[tensor])}, its manifest records {_shown(recorded[tensor])}"
        else:
            continue
        raise CorruptCheckpoint(path, f"{name} {reason}")


def _shown(described: Any) -> str:
    """A tensor's record in words, ``float32 [8, 4] at [0, 0]``; a hand-written one cut short."""
    if isinstance(described, list) and len(described) == 3:
        dtype, shape, offsets = described
        return f"{dtype} {shape} at {offsets}"[:200]
    return repr(described)[:200]


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
