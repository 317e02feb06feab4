"""The engine's options resolved from ``rollout.hf``: no ``auto`` left, the model directory checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from skip_core.backend import local_model_dir
from skip_core.config import ConfigError

from skip_plugin_hf.config import HFConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFOptions:
    """Where and how the model runs, resolved."""

    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int = 64
    batching: str = "continuous"


def resolve(config: HFConfig, model_dir: Path) -> HFOptions:
    """The options of an engine on this machine, for the model in ``model_dir``."""
    check_device(config.device)
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    dtype = DTYPES[config.dtype] if config.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    return HFOptions(local_model_dir(model_dir), device, dtype, config.max_batch_size, config.batching)


def check_device(name: str) -> None:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("rollout.hf.device: 'cuda' requested but torch finds no CUDA device")
