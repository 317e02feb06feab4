"""The engine's settings resolved from ``rollout.hf`` on this machine: no ``auto`` left, the model directory checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from skip_core.backend import local_model_dir
from skip_core.config import ConfigError

from skip_plugin_hf.options import HFOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Resolved:
    """Where and how the model runs, resolved."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int = 64
    batching: str = "continuous"
    config_overrides: Mapping[str, Any] = field(default_factory=dict)


def resolve(options: HFOptions, model_dir: Path) -> Resolved:
    """The settings of an engine on this machine, for the model in ``model_dir``."""
    check_device(options.device)
    if options.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(options.device)
    dtype = DTYPES[options.dtype] if options.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    return Resolved(
        local_model_dir(model_dir), device, dtype, options.max_batch_size, options.batching, options.config_overrides
    )


def check_device(name: str) -> None:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("rollout.hf.device: 'cuda' requested but torch finds no CUDA device")
