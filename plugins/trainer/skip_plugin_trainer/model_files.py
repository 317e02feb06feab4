"""A model directory's JSON files, read as hostile before transformers parses them: a downloaded
model is a file someone else wrote, and transformers reads its JSON with ``json``, unbounded, so a
pipe blocks it, ``/dev/zero`` never ends and deep nesting raises ``RecursionError`` far from the
file. Links are followed (the hub's cache links each file of a snapshot to its blob); what they
lead to must be a regular file, bounded in size and nesting (``skip_core.reading``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from skip_core import reading
from skip_core.config import ConfigError
from skip_core.escaping import printable

#: What transformers parses with ``json`` when it loads a causal LM, its tokenizer and its
#: generation settings (``tokenizer.json`` goes to the tokenizers library, which bounds its nesting).
PARSED = (
    "config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json",
)  # fmt: skip
#: Far above any published model's (a tokenizer_config.json with 150,000 added tokens is ~20 MB).
MAX_JSON_BYTES = 64 << 20


def read_json(model_dir: str | Path, name: str, limit: int = MAX_JSON_BYTES) -> Any:
    """``name`` in ``model_dir``, through its links; ``UnsafeFile`` naming what is wrong, and
    ``OSError`` (``FileNotFoundError`` among them) passed through."""
    return reading.read_json(Path(model_dir, name).resolve(), limit)


def check(model_dir: str | Path, key: str) -> None:
    """``ConfigError`` naming ``key`` and the file when a JSON file of ``model_dir`` that
    transformers would parse is not one it can read safely. A path that is no directory is left
    to transformers, which says what it is."""
    if not Path(model_dir).is_dir():
        return
    for name in PARSED:
        path = Path(model_dir, name)
        if not os.path.lexists(path):
            continue
        try:
            read_json(model_dir, name)
        except (reading.UnsafeFile, OSError) as exc:
            raise ConfigError(f"{key}: {printable(str(path))}: {printable(str(exc))}") from None
