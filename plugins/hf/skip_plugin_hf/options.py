"""The ``rollout.hf`` settings and the model directory, checked once when the backend is built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from skip_core.backend import local_model_dir
from skip_core.config import ConfigError, is_hydra_marker, select, to_container

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFOptions:
    """Where and how the model runs; ``device`` and ``dtype`` are resolved (no ``auto``)."""

    model_dir: Path | None
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int = 64


def parse_options(config: Any, with_model: bool = True) -> HFOptions:
    """Read ``rollout.model_path`` and ``rollout.hf.*``, failing with the key that is wrong.

    ``with_model=False`` is the driver's check, made before the task has built the model; on a
    Ray cluster (``RAY_ADDRESS``) the driver's machine is not the workers', so it leaves the device alone.
    """
    raw = to_container(select(config, "hf")) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"rollout.hf: expected a mapping of settings, got {raw!r}")
    allowed = ("device", "dtype", "max_batch_size")
    for key in raw:
        if key not in allowed and not is_hydra_marker(key):
            raise ConfigError(f"rollout.hf.{key}: unknown key (allowed: {', '.join(allowed)})")
    device = _device(raw.get("device", "auto"), here=with_model or "RAY_ADDRESS" not in os.environ)
    return HFOptions(
        model_dir=local_model_dir(select(config, "model_path")) if with_model else None,
        device=device,
        dtype=_dtype(raw.get("dtype"), device),
        max_batch_size=_positive(raw.get("max_batch_size", 64), "rollout.hf.max_batch_size"),
    )


def _device(name: Any, here: bool) -> torch.device:
    if name not in DEVICES:
        raise ConfigError(f"rollout.hf.device: expected one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and here and not torch.cuda.is_available():
        raise ConfigError("rollout.hf.device: 'cuda' requested but torch finds no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _dtype(name: Any, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"rollout.hf.dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: expected an integer >= 1, got {value!r}")
    return value
