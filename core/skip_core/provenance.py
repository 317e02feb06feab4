"""What produced a cache entry: the model, its sampling, the backend, the tools, the chat template.

An entry replays exactly only under the setup that generated it. A cache made at
``temperature=1.0`` and replayed at 0.3, or made with another model, would otherwise load with no
word, its only trace a ``training/rollout_probs_diff_mean`` far above a faithful replay's.
``Setup`` reads the setup from verl's config keys (``Setup.from_config``) or from the sections a
trainer validated; every entry records it (``setup`` in ``meta.json``) and a lookup compares
it under ``skip.<role>.on_setup_mismatch``.

The model is named by a digest of its config and of its weight files' index (names, sizes,
safetensors headers and a few sampled blocks), not of every byte: a copy of the model is the same
model, another checkpoint of the same architecture is not, and a 70B model is named in
milliseconds. Keys that do not change what is generated (a loss, an optimizer, engine memory)
are not part of it, so replaying across a deliberate change of the learning side stays silent.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import xxhash

from skip_core import reading
from skip_core.config import select, to_container
from skip_core.files import package_file

ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"
# Sampling settings, by verl's names (skip's trainer uses the same ones).
SAMPLING = ("temperature", "top_p", "top_k", "do_sample", "seed", "stop", "stop_token_ids", "max_model_len")
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_BLOCKS, _BLOCK = 16, 64 * 1024  # sampled from each weight file: 1 MiB, whatever its size
_SMALL = 16 << 20  # config files, templates, tool files and safetensors headers are read whole up to this


class Setup:
    """The setup a run generates under, read from its config; the files behind it (model, chat
    template, tools) are read on first use, when a task may have built them meanwhile."""

    def __init__(self, rollout: Any, model: Any) -> None:
        """``rollout`` and ``model``: the two sections as plain mappings, by verl's key names or
        skip's (``backend`` or ``name``, ``tools_config`` or ``tool_config_path``)."""
        self._rollout = rollout if isinstance(rollout, dict) else {}
        self._model = model if isinstance(model, dict) else {}
        self._told: set[tuple] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process needs: the sections, not the lock or what was told here."""
        return {"_rollout": self._rollout, "_model": self._model}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_rollout"], state["_model"])

    @classmethod
    def from_config(cls, config: Any) -> Setup:
        """The setup of a verl run config (``actor_rollout_ref.rollout``, ``actor_rollout_ref.model``)."""
        return cls(_section(config, ROLLOUT), _section(config, MODEL))

    def first(self, *key: Any) -> bool:
        """Whether ``key`` is new to this run (a warning given once per run and difference)."""
        with self._lock:
            new = key not in self._told
            self._told.add(key)
            return new

    @cached_property
    def values(self) -> dict[str, Any]:
        """Every key of the setup, ``None`` where the config has no value: ``{"rollout.temperature": 1.0,
        "model.path": <digest of the model's files>, ...}``."""
        rollout, turns = self._rollout, self._rollout.get("multi_turn") or {}
        backend = rollout.get("name") or rollout.get("backend")  # verl's key, skip's key
        engine = (rollout.get("engine_kwargs") or {}).get(backend) or {}
        values = {f"rollout.{key}": rollout.get(key) for key in SAMPLING}
        values["rollout.backend"] = backend
        values["rollout.dtype"] = rollout.get("dtype") or (engine.get("dtype") if isinstance(engine, dict) else None)
        values["rollout.multi_turn.max_turns"] = turns.get("max_turns") or turns.get("max_assistant_turns")
        values["rollout.multi_turn.max_user_turns"] = turns.get("max_user_turns")
        tools = turns.get("tools_config") or turns.get("tool_config_path")  # skip's key, verl's key
        values["rollout.multi_turn.tools_config"] = _file_digest(tools)
        # Named by the keys that choose them, valued by what they hold: a copy elsewhere is no change.
        path = self._model.get("path")
        values["model.path"] = model_digest(path) if path else None
        values["model.chat_template"] = chat_template_digest(path, self._model.get("custom_chat_template"))
        values["model.override_config"] = self._model.get("override_config") or None  # the engine's model too
        return json.loads(json.dumps(values, default=str))  # as meta.json will hold it


def _section(config: Any, key: str) -> Any:
    """A plain copy of a config section; empty where it does not resolve (an interpolation to a
    key this config lacks): what cannot be read is not compared."""
    try:
        return to_container(select(config, key)) or {}
    except Exception:
        return {}


def differences(recorded: Any, current: dict[str, Any]) -> list[str]:
    """The keys whose values differ between an entry's recorded setup and this run's, in words
    (``rollout.temperature (1.0 there, 0.3 here)``). Only keys both know are compared: an entry
    from a skip that recorded fewer keys, or none, is judged on what it has."""
    if not isinstance(recorded, dict):
        return []
    keys = sorted(key for key in current.keys() & recorded.keys() if recorded[key] != current[key])
    return [f"{key} ({_short(recorded[key])} there, {_short(current[key])} here)" for key in keys]


def model_digest(path: str | os.PathLike) -> str:
    """A name for the model at ``path`` that changes with its config or weights: a digest of
    ``config.json``, ``generation_config.json`` and each weight file's name, size, index or
    safetensors header, and sampled blocks. A path that is not a local directory (a hub id) is its
    own name."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return f"name:{path}"
    digest = xxhash.xxh3_128()
    for name in ("config.json", "generation_config.json"):
        _add(digest, name, _read(directory / name))
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        names = []  # an unreadable directory: the backend loading the model will say so
    for file in (directory / name for name in names if name.endswith((*WEIGHTS, ".index.json"))):
        try:
            info = file.stat()  # following links: a Hugging Face cache links its files to blobs
            if not stat.S_ISREG(info.st_mode):
                continue
            _add(digest, file.name, str(info.st_size).encode())
            with open(file, "rb") as f:
                if file.name.endswith(".index.json"):
                    _add(digest, "index", f.read(_SMALL))
                    continue
                if file.name.endswith(".safetensors"):
                    size = int.from_bytes(f.read(8), "little")
                    _add(digest, "header", f.read(min(size, _SMALL)))
                for block in range(_BLOCKS):
                    f.seek(info.st_size * block // _BLOCKS)
                    digest.update(f.read(_BLOCK))
        except OSError:
            continue  # an unreadable file: the backend loading the model will say so
    return digest.hexdigest()


def chat_template_digest(path: str | os.PathLike | None, custom: str | None = None) -> str | None:
    """A digest of the chat template prompts are rendered with: ``custom_chat_template``, else the
    model directory's ``chat_template.jinja`` / ``chat_template.json`` / ``tokenizer_config.json``'s
    ``chat_template``; ``None`` where there is none."""
    texts = [custom.encode()] if custom else []
    directory = Path(path).expanduser() if path else None
    if not texts and directory is not None and directory.is_dir():
        texts = [_read(directory / name) for name in ("chat_template.jinja", "chat_template.json")]
        try:
            tokenizer = reading.loads(_read(directory / "tokenizer_config.json") or b"{}")  # nesting bounded
        except ValueError:
            tokenizer = {}
        template = tokenizer.get("chat_template") if isinstance(tokenizer, dict) else None
        texts.append(json.dumps(template).encode() if template else b"")
    texts = [text for text in texts if text]
    return xxhash.xxh3_128_hexdigest(b"\0".join(texts)) if texts else None


def _file_digest(path: str | None) -> str | None:
    """A digest of a config file's content (``pkg://`` paths resolved); its path where it cannot be read."""
    if not path:
        return None
    try:
        data = _read(package_file(str(path)))
    except ModuleNotFoundError:  # pkg:// naming a package not installed: the run's own check says so
        data = None
    return xxhash.xxh3_128_hexdigest(data) if data is not None else f"path:{path}"


def _read(path: Path) -> bytes | None:
    """A small regular file's bytes (links followed: these are the user's own files), else ``None``."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            return f.read(_SMALL)
    except OSError:
        return None


def _add(digest: Any, name: str, data: bytes | None) -> None:
    digest.update(f"{name}\0{len(data) if data is not None else -1}\0".encode())
    digest.update(data or b"")


def _short(value: Any) -> str:
    """A value as a warning shows it: a digest cut to 12 characters."""
    if isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value):
        return value[:12]
    return repr(value)
